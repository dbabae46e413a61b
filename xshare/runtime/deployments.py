"""A Runtime's deployed models (serving): ``deploy``, ``undeploy``, ``models``, ``model``.

The models themselves (compiled buckets, queues, the dispatcher's hub) are ``models.py``; this is
the part of the public ``Runtime`` that hands them over to the dispatcher.
"""

from __future__ import annotations

import logging
from typing import Any

from .._errors import XShareError

log = logging.getLogger("xshare.runtime")


class Deployments:
    """A part of ``Runtime``: its models next to its jobs."""

    def deploy(self, spec: Any) -> Any:
        """Deploy a model (``xshare.model(...)``) next to the jobs.

        Compiles ``predict`` for each padded batch size on this thread, admits the model by
        memory (params persistent, the largest bucket ephemeral), puts the params on the device
        once, and from then on the dispatcher runs its batches between training steps. HTTP:
        ``POST /v2/models/{name}/infer``.

        Returns:
          The model's :class:`ModelHandle`.

        Raises:
          AdmissionError: the model does not fit in the arena now (it does not wait in the job
            queue); the message names its ``P + E`` and what is free.
          TypeError: ``spec`` is not from ``xshare.model``.
        """
        from ..serving.spec import ModelSpec
        from .deployed.hub import Hub, ModelHandle
        from .deployed.models import Deployed

        if not isinstance(spec, ModelSpec):
            raise TypeError(f"deploy takes a model spec from xshare.model(predict, params, inputs=...); "
                            f"got {type(spec).__name__}")
        if self._closed:
            raise XShareError("this runtime is closed; deploy to a live one")
        hub = self._dispatcher.serving
        if hub is not None and (spec.name, spec.version) in hub.models:
            raise XShareError(f"a model named {spec.name!r} is already deployed at version {spec.version}; undeploy "
                              "it first, pick another name, or deploy another version (version=N)")
        deployed = Deployed(spec, self.device)  # compiles here, off the dispatcher's thread
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
        """Stop taking requests for model ``name`` (every version, or only ``version``), answer
        those queued, free its memory; requests to its other versions go on meanwhile.
        ``KeyError`` naming the deployed models (or versions) if there is none."""
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
        """The deployed models' handles, by name (each follows its name's default version)."""
        from .deployed.hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        return {} if hub is None else {n: ModelHandle(hub, v[0], pinned=False) for n, v in hub.by_name.items()}

    def model(self, name: str, version: int | None = None) -> Any:
        """A deployed model's handle: ``version``, or (None) whichever version is the name's
        default at each call, the highest ready one. ``KeyError`` naming what is deployed otherwise."""
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
        """Each deployed version of ``name`` (lowest first), as handles of that version."""
        from .deployed.hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        return [] if hub is None else [ModelHandle(hub, m) for m in reversed(hub.by_name.get(name, ()))]

