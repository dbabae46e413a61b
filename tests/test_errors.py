"""Every exception class xshare defines derives from ``xshare.XShareError``, so a user's
``except xshare.XShareError`` catches whatever xshare raises on purpose; the ones that are also
a builtin kind (``EvalError`` is a ``ValueError``) keep that base too."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import xshare
import xshare.models
from xshare._errors import XShareError

# BaseException signals that must NOT be an Exception: an ``except Exception`` in user code must
# let them through (Ctrl-C stopping a study). Each entry says why.
NOT_ERRORS = {
    "xshare.tune._optimize.Interrupted": "a KeyboardInterrupt: Ctrl-C must pass `except Exception`",
}


def modules() -> list[str]:
    """Every Python module of the installed package and the model zoo (not the FFI .so files)."""
    names = []
    for pkg in (xshare, xshare.models):
        names.append(pkg.__name__)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            spec = importlib.util.find_spec(info.name)
            if spec is not None and (spec.origin or "").endswith(".py"):
                names.append(info.name)
    return names


def exception_classes() -> list[type[BaseException]]:
    found = []
    for name in modules():
        mod = importlib.import_module(name)
        found += [obj for obj in vars(mod).values()
                  if inspect.isclass(obj) and issubclass(obj, BaseException)
                  and obj.__module__ == mod.__name__]
    return found


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_the_walk_finds_the_known_errors():
    # The walk itself must work: it finds errors of the runtime, the FFI build, nnx and the zoo.
    names = {qualname(c) for c in exception_classes()}
    assert {"xshare.runtime.compiled.eval_programs.EvalError", "xshare.nnx.NnxStepError",
            "xshare.ffi._build.BuildError", "xshare.models.common.HyperparameterError",
            "xshare._errors.SpecError"} <= names


def test_every_xshare_exception_derives_from_xshare_error():
    offenders = [qualname(c) for c in exception_classes()
                 if qualname(c) not in NOT_ERRORS and not issubclass(c, XShareError)]
    assert offenders == [], (f"{offenders} do not derive from xshare._errors.XShareError: add it "
                             "as the first base (keep a builtin base such as ValueError after it)")


def test_the_exemptions_are_still_base_exceptions_only():
    # An exemption that became an Exception (or vanished) must leave the list.
    by_name = {qualname(c): c for c in exception_classes()}
    for name in NOT_ERRORS:
        assert name in by_name, f"{name} no longer exists: remove it from NOT_ERRORS"
        assert not issubclass(by_name[name], Exception), name


@pytest.mark.parametrize("cls, builtin", [
    ("xshare.runtime.compiled.eval_programs.EvalError", ValueError),
    ("xshare.nnx.NnxStepError", TypeError),
    ("xshare.ffi._build.BuildError", RuntimeError),
    ("xshare.runtime.engine.states.IllegalTransition", RuntimeError),
    ("xshare.cli.top.fetch.NotAStatus", ValueError),
])
def test_errors_keep_their_builtin_base(cls, builtin):
    # Callers that catch the builtin kind (ValueError from bind, RuntimeError from a build) still do.
    module, name = cls.rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), name), builtin)
