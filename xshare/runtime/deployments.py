"""A Runtime's deployed models (serving): ``deploy``, ``undeploy``, ``models``, ``model``.

The models themselves (compiled buckets, queues, the dispatcher's hub) are ``models.py``; this is
what the public ``Runtime``'s methods of the same names delegate to: it hands them over to the
dispatcher.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from .._errors import XShareError

if TYPE_CHECKING:
    from .engine.dispatcher import Dispatcher

log = logging.getLogger("xshare.runtime")


class Deployments:
    """``Runtime``'s models next to its jobs: what ``Runtime.deploy``, ``undeploy``, ``models``,
    ``model`` and ``model_versions`` call (their docstrings are the users')."""

    def __init__(self, dispatcher: Dispatcher, device: Any, closed: Callable[[], bool]) -> None:
        self._dispatcher = dispatcher
        self._device = device
        self._closed = closed
        self._lock = threading.Lock()  # the hub is made once, by the first deploy

    def deploy(self, spec: Any) -> Any:
        """Compile, admit and start serving ``spec``; its handle (see ``Runtime.deploy``)."""
        from ..serving.spec import ModelSpec
        from .deployed.hub import Hub, ModelHandle
        from .deployed.models import Deployed

        if not isinstance(spec, ModelSpec):
            raise TypeError(f"deploy takes a model spec from xshare.model(predict, params, inputs=...); "
                            f"got {type(spec).__name__}")
        if self._closed():
            raise XShareError("this runtime is closed; deploy to a live one")
        hub = self._dispatcher.serving
        if hub is not None and (spec.name, spec.version) in hub.models:
            raise XShareError(f"a model named {spec.name!r} is already deployed at version {spec.version}; undeploy "
                              "it first, pick another name, or deploy another version (version=N)")
        deployed = Deployed(spec, self._device)  # compiles here, off the dispatcher's thread
        d = self._dispatcher
        with self._lock:
            if d.serving is None:
                d.serving = Hub(d)
        d.call(d.serving.add, deployed)
        try:
            deployed.put_params()
            deployed.state = "ready"  # from here requests are taken
        except BaseException:
            d.call(d.serving.remove, deployed.key)
            raise
        log.info("xshare: deployed model %r version %d (buckets %s, compiled in %.2f s)", spec.name, spec.version,
                 list(spec.buckets), deployed.compile_s)
        return ModelHandle(d.serving, deployed)

    def undeploy(self, name: str, version: int | None = None) -> None:
        hub = self._dispatcher.serving
        versions = hub.by_name.get(name, ()) if hub is not None else ()
        if not versions:
            raise KeyError(f"no model {name!r} is deployed; models: {', '.join(sorted(self.models)) or '(none)'}")
        gone = [m for m in versions if version is None or m.version == version]
        if not gone:
            raise KeyError(f"model {name!r} has no version {version!r} deployed; versions: "
                           f"{', '.join(str(m.version) for m in reversed(versions))}")
        for m in gone:
            self._dispatcher.call(hub.remove, m.key)
        log.info("xshare: undeployed model %r%s", name, "" if version is None else f" version {version}")

    @property
    def models(self) -> dict[str, Any]:
        from .deployed.hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        return {} if hub is None else {n: ModelHandle(hub, v[0], pinned=False) for n, v in hub.by_name.items()}

    def model(self, name: str, version: int | None = None) -> Any:
        from .deployed.hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        versions = hub.by_name.get(name, ()) if hub is not None else ()
        if not versions:
            raise KeyError(f"no model {name!r} is deployed; models: {', '.join(sorted(self.models)) or '(none)'}")
        if version is None:
            return ModelHandle(hub, versions[0], pinned=False)
        m = next((m for m in versions if m.version == version), None)
        if m is None:
            raise KeyError(f"model {name!r} has no version {version!r} deployed; versions: "
                           f"{', '.join(str(m.version) for m in reversed(versions))}")
        return ModelHandle(hub, m)

    def model_versions(self, name: str) -> list[Any]:
        from .deployed.hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        return [] if hub is None else [ModelHandle(hub, m) for m in reversed(hub.by_name.get(name, ()))]

