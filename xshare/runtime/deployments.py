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
        from .hub import Hub, ModelHandle
        from .models import Deployed

        if not isinstance(spec, ModelSpec):
            raise TypeError(f"deploy takes a model spec from xshare.model(predict, params, inputs=...); "
                            f"got {type(spec).__name__}")
        if self._closed:
            raise XShareError("this runtime is closed; deploy to a live one")
        if spec.name in self.models:
            raise XShareError(f"a model named {spec.name!r} is already deployed; undeploy it first or "
                              "pick another name")
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
            d.call(d.serving.remove, spec.name)
            raise
        log.info("xshare: deployed model %r (buckets %s, compiled in %.2f s)", spec.name,
                 list(spec.buckets), deployed.compile_s)
        return ModelHandle(self, deployed)

    def undeploy(self, name: str) -> None:
        """Stop taking requests for model ``name``, answer those queued, free its memory.
        ``KeyError`` naming the deployed models if there is none of that name."""
        hub = self._dispatcher.serving
        if hub is None or name not in hub.models:
            raise KeyError(f"no model {name!r} is deployed; models: {', '.join(sorted(self.models)) or '(none)'}")
        self._dispatcher.call(hub.remove, name)
        log.info("xshare: undeployed model %r", name)

    @property
    def models(self) -> dict[str, Any]:
        """The deployed models' handles, by name."""
        from .hub import ModelHandle

        hub = self._dispatcher.serving if self._dispatcher is not None else None
        return {} if hub is None else {n: ModelHandle(self, m) for n, m in hub.models.items()}

    def model(self, name: str) -> Any:
        """A deployed model's handle; ``KeyError`` naming the deployed ones otherwise."""
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"no model {name!r} is deployed; models: {', '.join(sorted(self.models)) or '(none)'}") from None

