"""The Python API reference (docs/reference/api.md, rendered by mkdocstrings) covers every public
name of xshare, and every public name and member has a docstring to render."""

from __future__ import annotations

import inspect
import re

from tests.docs import blocks

API = (blocks.REPO / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
DIRECTIVES = re.findall(r"^::: (\S+)", API, flags=re.M)


def _members(path: str) -> list[str]:
    """``options: members: [a, b]`` under a directive, if given."""
    m = re.search(rf"^::: {re.escape(path)}\n((?:    .*\n)+)", API, flags=re.M)
    listed = m and re.search(r"members:\s*\[([^\]]*)\]", m[1])
    return [x.strip() for x in listed[1].split(",")] if listed else []


def _public_api() -> dict[str, object]:
    import xshare.ffi
    import xshare.nnx
    import xshare.tune

    names = {f"xshare.{n}": getattr(xshare, n) for n in xshare.__all__}
    names |= {f"xshare.nnx.{n}": getattr(xshare.nnx, n) for n in xshare.nnx.__all__}
    names |= {f"xshare.tune.{n}": getattr(xshare.tune, n) for n in xshare.tune.__all__}
    for n in ("ensure_loaded", "available", "unavailable_reason"):  # the ones the docs tell users to call
        names[f"xshare.ffi.{n}"] = getattr(xshare.ffi, n)
    return names


def _documented(path: str) -> bool:
    if path in DIRECTIVES:
        return True
    parent, _, name = path.rpartition(".")
    return parent in DIRECTIVES and name in _members(parent)


def test_every_public_name_is_in_the_reference():
    missing = [p for p in _public_api() if not _documented(p)]
    assert not missing, f"add these to docs/reference/api.md (a '::: NAME' line): {missing}"


def test_every_public_name_and_member_has_a_docstring():
    missing = []
    for path, obj in _public_api().items():
        if path == "xshare.POLICIES":  # a tuple: its docstring is the string after it (griffe reads it)
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(path)
        if not inspect.isclass(obj):
            continue
        for name in dir(obj):
            owner = next((c for c in obj.__mro__ if name in c.__dict__), None)
            if name.startswith("_") or owner is None or not owner.__module__.startswith("xshare"):
                continue
            raw = owner.__dict__[name]
            fn = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
            if inspect.isfunction(fn) and not (fn.__doc__ or "").strip():
                missing.append(f"{path}.{name}")
    assert not missing, f"public names without a docstring (the reference would show nothing): {missing}"


def test_policies_have_their_docstring_in_the_source():
    source = (blocks.REPO / "xshare" / "sched" / "__init__.py").read_text(encoding="utf-8")
    assert re.search(r'^POLICIES: .*\n""".+', source, flags=re.M)
