"""From ``"module:function"`` to the factory: its signature (for checking a plan) and the
function itself (for building jobs).

Planning a launch (``--dry-run`` included) only needs each factory's *signature*. Factories
import jax and flax at module level, so :func:`signature` reads the signature from the
module's source with :mod:`ast` when the function is a plain top-level ``def`` whose defaults
are literals, and imports the module only when it cannot (a decorated function, an assigned
name, a computed default). Building a job (:func:`resolve_entry`) always imports it.

``models.<name>`` is the deprecated spelling of ``xshare.models.<name>``: it keeps resolving to
the repository's ``models/`` folder from a checkout, and to the installed ``xshare.models``
otherwise, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import logging
import pkgutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from xshare._errors import SpecError

log = logging.getLogger("xshare.spec")

_OLD_MODELS, _NEW_MODELS = "models", "xshare.models"


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def split_entry(entry: Any, who: str) -> tuple[str, str]:
    if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
        raise SpecError(f"{who}: entry {entry!r} must be 'module:function' (e.g. 'xshare.models.mlp:make_job')")
    module_name, func_name = entry.split(":")
    return _module_name(module_name), func_name


def _module_name(name: str) -> str:
    """``models.mlp`` -> itself from a checkout (the folder is importable), else
    ``xshare.models.mlp`` with a deprecation warning."""
    if name != _OLD_MODELS and not name.startswith(_OLD_MODELS + "."):
        return name
    try:
        if importlib.util.find_spec(_OLD_MODELS) is not None:
            return name
    except (ImportError, ValueError):
        pass
    new = _NEW_MODELS + name[len(_OLD_MODELS):]
    message = (f"entry module {name!r} resolves to the installed {new!r}: write {new!r} "
               "(the top-level 'models' name is deprecated)")
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning("%s", message)
    return new


def _find_module(module_name: str, who: str) -> Any:
    try:
        found = importlib.util.find_spec(module_name)
    except ModuleNotFoundError as err:  # a parent package is missing
        found, missing = None, err.name or module_name
    except Exception as err:  # noqa: BLE001 - a parent package raised while importing
        raise SpecError(f"{who}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    else:
        missing = module_name
    if found is None:
        raise SpecError(
            f"{who}: no module named {missing!r}{did_you_mean(missing, _sibling_modules(missing))}. "
            "Modules resolve from the current directory and the installed packages; run from the directory that holds it."
        )
    return found


def resolve_entry(entry: Any, who: str) -> Callable[..., Any]:
    """``"xshare.models.mlp:make_job"`` -> the function (imports its module). Errors list close
    matches when there are any."""
    module_name, func_name = split_entry(entry, who)
    _find_module(module_name, who)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise SpecError(f"{who}: importing {module_name!r} failed: {err} (a dependency of that module is missing)") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: show what, not our traceback
        raise SpecError(f"{who}: importing {module_name!r} raised {type(err).__name__}: {err}") from None

    fn = getattr(module, func_name, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        hint = did_you_mean(func_name, names)
        if not hint:
            own = [n for n in names if getattr(getattr(module, n), "__module__", None) == module.__name__]
            hint = f"; it defines: {', '.join(own[:12])}" if own else ""
        raise SpecError(f"{who}: module {module_name!r} has no function {func_name!r}{hint}")
    if not callable(fn):
        raise SpecError(f"{who}: {entry} is not a function (it is a {type(fn).__name__} value); name a function that returns a bound job")
    return fn


def signature(entry: Any, who: str) -> inspect.Signature | None:
    """The factory's signature, read from source when possible (no import), else by importing
    it. None when it has none Python can read (a builtin): nothing to check before calling."""
    module_name, func_name = split_entry(entry, who)
    found = _find_module(module_name, who)
    static = _static_signature(found.origin, func_name) if found.origin else None
    if static is not None:
        return static
    fn = resolve_entry(entry, who)
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _static_signature(path: str, func_name: str) -> inspect.Signature | None:
    """The signature of an undecorated top-level ``def func_name`` whose defaults are literals;
    None when the source does not say it that plainly (then the caller imports)."""
    if not path.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func_name]
    others = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.ImportFrom, ast.Import))
              and func_name in _bound_names(n)]
    if len(defs) != 1 or others or defs[0].decorator_list:
        return None
    try:
        return _from_arguments(defs[0].args)
    except ValueError:  # a default that is not a literal
        return None


def _bound_names(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return set()
    return {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}


def _from_arguments(args: ast.arguments) -> inspect.Signature:
    P = inspect.Parameter
    params: list[inspect.Parameter] = []
    positional = args.posonlyargs + args.args
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=default))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else ast.literal_eval(default)))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _sibling_modules(dotted: str) -> list[str]:
    parent, _, _ = dotted.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return []
    prefix = parent + "." if parent else ""
    return [prefix + m.name for m in pkgutil.iter_modules(path)]


def check_params(sig: inspect.Signature | None, params: Mapping[str, Any], who: str, hint: str = ".") -> bool:
    """Check ``fn(**params)`` binds to ``sig``; return whether the factory takes ``steps=``."""
    if sig is None:  # builtins and C functions: nothing to check before calling
        return True
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in sig.parameters.values())
    named = [p.name for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    if not var_kw:
        for key in params:
            if key not in named:
                raise SpecError(
                    f"{who}: the factory does not accept parameter {key!r}{did_you_mean(key, named)}{hint} "
                    f"It accepts: {', '.join(named) or '(no parameters)'}."
                )
    variadic = (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
    required = [
        p.name
        for p in sig.parameters.values()
        if p.default is kinds.empty and p.kind not in variadic and p.name not in params
    ]
    if required:
        raise SpecError(f"{who}: the factory needs {', '.join(repr(r) for r in required)}; set it under params (or with --set NAME=VALUE)")
    return var_kw or "steps" in named


def steps_default(sig: inspect.Signature | None) -> int | None:
    param = sig.parameters.get("steps") if sig is not None else None
    default = getattr(param, "default", None)
    return default if isinstance(default, int) and not isinstance(default, bool) else None
