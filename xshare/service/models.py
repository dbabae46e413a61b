"""Models as plain data: ``{"entry": "module:function", "params": {...}, "name": N, "version": V}``, what
``xshare serve --model``, ``xshare deploy`` and ``POST /models`` carry instead of a closure.

The entry is a model factory (``xshare.models.inference:make_model``) returning an
``xshare.model(...)`` spec; only the service imports and calls it (:meth:`ModelRequest.build`).
Pure Python here: a client needs neither jax nor the module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._errors import SpecError
from ..jobs.request import RequestError, _check_json_value

FIELDS = ("entry", "params", "name", "version")


@dataclass(frozen=True)
class ModelRequest:
    entry: str
    params: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    version: int | None = None  # None: the factory's (1 unless it says otherwise)

    def __post_init__(self) -> None:
        e = self.entry
        if not isinstance(e, str) or e.count(":") != 1 or not all(p.strip() for p in e.split(":")):
            raise RequestError(f"model: entry = {e!r} must be 'module:function' "
                               "(e.g. 'xshare.models.inference:make_model')")
        if not isinstance(self.params, Mapping) or not all(isinstance(k, str) and k.isidentifier()
                                                           for k in self.params):
            raise RequestError(f"model: params = {self.params!r} must be a table of keyword arguments")
        _check_json_value(dict(self.params), "model: params")
        if self.name is not None and not isinstance(self.name, str):
            raise RequestError(f"model: name = {self.name!r} must be a string")
        if self.version is not None and (not isinstance(self.version, int) or isinstance(self.version, bool)
                                         or self.version < 1):
            raise RequestError(f"model: version = {self.version!r} must be an int >= 1")
        object.__setattr__(self, "params", dict(self.params))

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "params": dict(self.params), **({"name": self.name} if self.name else {}),
                **({"version": self.version} if self.version is not None else {})}

    @classmethod
    def from_json(cls, data: Any) -> "ModelRequest":
        if not isinstance(data, Mapping):
            raise RequestError('a model is a JSON object {"entry": "module:function", "params": {...}, "name": N}; '
                               f"got {type(data).__name__}")
        unknown = [k for k in data if k not in FIELDS]
        if unknown:
            raise RequestError(f"model: unknown key {unknown[0]!r}; a model has {', '.join(FIELDS)}")
        if "entry" not in data:
            raise RequestError("model: missing 'entry' (\"module:function\")")
        return cls(**{k: data[k] for k in FIELDS if k in data and data[k] is not None})

    def build(self) -> Any:
        """Import the entry, call it with ``params``; the ``ModelSpec`` (renamed to ``name``).
        SpecError with a one-line reason otherwise."""
        from xshare.jobs.resolve import check_params, resolve_entry, signature
        from xshare.serving.spec import ModelSpec, NAME_RE

        who = f"model {self.entry}"
        fn = resolve_entry(self.entry, who)
        check_params(signature(self.entry, who), self.params, who)
        try:
            spec = fn(**self.params)
        except Exception as err:  # noqa: BLE001 - the factory's own error, in one line
            raise SpecError(f"{who}: the factory raised {type(err).__name__}: {err}") from None
        if not isinstance(spec, ModelSpec):
            raise SpecError(f"{who}: returned a {type(spec).__name__}; a model factory returns "
                            "xshare.model(predict, params, inputs=...)")
        if self.name:
            if not NAME_RE.match(self.name):
                raise SpecError(f"model name {self.name!r} must be letters, digits, '_', '.', '-' (a URL segment)")
            spec = dataclasses.replace(spec, name=self.name)
        if self.version is not None:
            spec = dataclasses.replace(spec, version=self.version)
        return spec


def from_cli(entry: str, sets: list[str], name: str | None = None, version: int | None = None) -> ModelRequest:
    """``ENTRY --set k=v ...`` as a request (one value per key: a model is not a sweep)."""
    from xshare.jobs.parse import parse_set

    params = {}
    for item in sets:
        key, value = parse_set(item)
        if isinstance(value, list):
            raise SpecError(f"--set {item!r}: a model takes one value per parameter (deploy twice, with "
                            "--name, for two)")
        params[key] = value
    return ModelRequest(entry, params, name, version)


__all__ = ["ModelRequest", "from_cli"]
