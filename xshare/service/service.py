"""``xshare serve``'s engine: one long-lived ``xshare.Runtime`` that owns the device, fed with
jobs as plain data over the status server's authenticated control API.

The service adds to a runtime only what a long-lived process needs:

* ``POST /jobs``: requests (:mod:`.jobs`) are built here, by importing their entry; a request
  the service cannot build is refused as a whole (422, the one-line reason), nothing starts.
  The answer waits until each job is past compiling, so a job that can never fit is reported
  with the admission numbers (422) instead of silently failing later.
* a journal, ``{run_dir}/service-jobs.jsonl``: every accepted request under its final name,
  so that ``--resume`` resubmits them all; the runtime resumes each from its checkpoint (a job
  that had finished comes back done at once). ``service-state.json`` records how each job
  stood at shutdown: cancelled and failed jobs are not restarted.
* names: a request's name (or its entry's module) made unique in this service with ``.2``,
  ``.3``...: submitting the same spec twice runs it twice. The answer says the names used.

Only the public ``Runtime`` API is used (submit_many, handle, snapshot, stop).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from .._errors import AdmissionError, SpecError, XShareError, error_line
from ..jobs.request import JobRequest, RequestError, loads

log = logging.getLogger("xshare.service")

JOURNAL = "service-jobs.jsonl"
MODELS_JOURNAL = "service-models.jsonl"  # deploy/undeploy records: --resume redeploys what was deployed
STATE = "service-state.json"
ANNOUNCE = "service.json"
_ADMIT_WAIT_S = 120.0  # how long POST /jobs waits for compiles before answering "compiling"


class Service:
    """A runtime, its status server with ``POST /jobs``, and the journal that ``--resume`` reads."""

    def __init__(self, *, run_dir: str | os.PathLike, memory: Any = None, policy: str = "pack",
                 host: str = "127.0.0.1", port: int = 0, resume: bool = False,
                 checkpoint_every: int | None = 100, fuse: bool = False, models: Sequence[Any] = (),
                 grpc_port: int | None = None, repository: dict[str, Any] | None = None):
        import xshare
        from xshare.runtime.web.server import StatusServer

        self.run_dir = Path(run_dir)
        self.journal = self.run_dir / JOURNAL
        if self.journal.exists() and not resume:
            raise XShareError(f"{self.run_dir} already holds a service's jobs ({JOURNAL}); pass --resume "
                              "to continue them, or give another --run-dir")
        self.models_journal = self.run_dir / MODELS_JOURNAL
        if self.models_journal.exists() and not resume:
            raise XShareError(f"{self.run_dir} already holds a service's models ({MODELS_JOURNAL}); pass "
                              "--resume to deploy them again, or give another --run-dir")
        if resume and not self.journal.exists() and not self.models_journal.exists():
            raise XShareError(f"--resume: {self.run_dir} has no {JOURNAL}; give the --run-dir of an "
                              "earlier `xshare serve`")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one submit at a time: names and the journal stay ordered
        # Every job checkpoints at its end and on stop() (checkpoint_dir given), and every N steps.
        # A service runs jobs without end: a done job's final state stays in its final
        # checkpoint only, not in this process's memory (keep_results=False).
        self.rt = xshare.Runtime(policy=policy, memory=memory, log_dir=self.run_dir,
                                 checkpoint_dir=self.run_dir, checkpoint_every=checkpoint_every,
                                 resume=resume, fuse=fuse, keep_results=False)
        try:
            self.resumed = self._resume() if resume and self.journal.exists() else []
            self.deployed = self._redeploy() if resume else []
            for req in models:  # before the address is announced
                name = self.deploy(req, skip_deployed=resume)  # on --resume it may be back already
                if name not in self.deployed:
                    self.deployed.append(name)
            self.repository = None  # --model-repository: Repository(rt, **repository) loads its models now
            if repository is not None:
                from xshare.service.repository import Repository
                self.repository = Repository(self.rt, **repository)
            self.server = StatusServer(self.rt, host, port, submit=self.submit_payload,
                                       deploy=self.deploy_payload, undeploy=self.undeploy_name,
                                       repository=self.repository,
                                       announce={"kind": "service", "run_dir": str(self.run_dir.resolve())})
            self.server.start()
            self.grpc = None  # the models over gRPC too (xshare serve --grpc-port), after they deploy
            if grpc_port is not None:
                from xshare.runtime.web.grpc_server import GrpcServer
                self.grpc = GrpcServer(self.rt, host, grpc_port, repository=self.repository,
                                       token=self.server.token).start()
            from xshare.runtime.web.discovery import write_private
            write_private(self.run_dir / ANNOUNCE, json.dumps(
                {"pid": os.getpid(), "address": self.server.address, "token": self.server.token,
                 **({"grpc_address": self.grpc.address} if self.grpc else {})}) + "\n")
        except BaseException:
            if getattr(self, "server", None) is not None:
                self.server.stop()
            repo = getattr(self, "repository", None)  # (unset if the failure came first)
            if repo is not None:
                repo.close()
            self.rt.close()
            raise

    @property
    def address(self) -> str:
        return self.server.address

    # ------------------------------------------------------------------ submit
    def submit_payload(self, payload: Any) -> dict[str, Any]:
        """``POST /jobs``: build every request, submit them together, wait for admission."""
        from xshare.runtime.web.server import Refused

        try:
            requests = loads(payload)
        except RequestError as err:
            raise Refused(400, str(err)) from None
        try:
            names, handles = self.submit(requests)
        except SpecError as err:  # cannot import the entry, a wrong parameter, the factory raised
            raise Refused(422, _one_line(err)) from None
        except XShareError as err:  # the runtime is closing
            raise Refused(503, _one_line(err)) from None
        deadline = time.monotonic() + _ADMIT_WAIT_S
        for h in handles:
            while h.status() == "compiling" and time.monotonic() < deadline:
                h.wait(timeout=0.05)
        jobs = [{"name": h.name, "status": h.status(), "error": h.error} for h in handles]
        refused = [h for h in handles if isinstance(h.exception, AdmissionError)]
        if refused:
            raise Refused(422, f"job {refused[0].name!r} can never fit: {refused[0].exception}",
                          {"jobs": jobs})
        return {"jobs": jobs}

    # ------------------------------------------------------------------ models
    def deploy(self, request: Any, *, journal: bool = True, skip_deployed: bool = False) -> str:
        """Build a model request (:mod:`.models`) and deploy it; its name. SpecError if the
        entry cannot be built; AdmissionError if it does not fit now."""
        return self._deploy(request, journal=journal, skip_deployed=skip_deployed).name

    def _deploy(self, request: Any, *, journal: bool = True, skip_deployed: bool = False) -> Any:
        spec = request.build()
        with self._lock:
            if skip_deployed and any(h.version == spec.version for h in self.rt.model_versions(spec.name)):
                return spec
            self.rt.deploy(spec)
            if journal:
                self._journal_model({"op": "deploy", **request.to_json(), "name": spec.name, "version": spec.version})
        log.info("service: deployed model %r version %d", spec.name, spec.version)
        return spec

    def _journal_model(self, record: dict[str, Any]) -> None:
        with self.models_journal.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _redeploy(self) -> list[str]:
        """Deploy again every model the journal leaves deployed (its last record is a deploy)."""
        from .models import ModelRequest

        if not self.models_journal.exists():
            return []
        live: dict[tuple[str, int], dict[str, Any]] = {}  # by (name, version); older records have no version: 1
        for line in self.models_journal.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.pop("op") == "deploy":
                    live[(rec["name"], rec.get("version") or 1)] = rec
                else:  # an undeploy: of one version, or (none named) of every version of the name
                    v = rec.get("version")
                    live = {k: r for k, r in live.items() if not (k[0] == rec["name"] and v in (None, k[1]))}
        return list(dict.fromkeys(self.deploy(ModelRequest.from_json(rec), journal=False) for rec in live.values()))

    def deploy_payload(self, payload: Any) -> dict[str, Any]:
        """``POST /models``: 400 a malformed request, 422 an entry that cannot be built or a model
        that cannot fit, 409 a name already deployed."""
        from xshare.runtime.web.server import Refused

        from .models import ModelRequest

        try:
            request = ModelRequest.from_json(payload)
        except RequestError as err:
            raise Refused(400, str(err)) from None
        try:
            spec = self._deploy(request)
        except (SpecError, AdmissionError) as err:
            raise Refused(422, _one_line(err)) from None
        except XShareError as err:  # a name already deployed, or the runtime is closing
            raise Refused(409, _one_line(err)) from None
        return {"model": spec.name, "version": spec.version, "status": "ready",
                "metadata": self.rt.model(spec.name, spec.version).metadata()}

    def undeploy_name(self, name: str, version: int | None = None) -> dict[str, Any]:
        """``DELETE /models/{name}[?version=V]``: every version, or one; 404 if none is deployed."""
        from xshare.runtime.web.server import Refused

        try:
            with self._lock:
                self.rt.undeploy(name, version)
                self._journal_model({"op": "undeploy", "name": name, **({"version": version} if version else {})})
        except KeyError as err:
            raise Refused(404, str(err.args[0])) from None
        log.info("service: undeployed model %r%s", name, f" version {version}" if version else "")
        return {"model": name, "status": "gone", **({"version": version} if version else {})}

    def submit(self, requests: list[JobRequest], *, names: list[str] | None = None,
               journal: bool = True) -> tuple[list[str], list[Any]]:
        """Build and submit ``requests`` (all or none); returns their names and handles."""
        with self._lock:
            taken = {h.name for h in self.rt.jobs}
            final = []
            for i, req in enumerate(requests):
                name = names[i] if names else _unique(req.name or req.default_name(), taken)
                taken.add(name)
                final.append(name)
            specs = [req.build(name) for req, name in zip(requests, final)]  # SpecError: none submitted
            if journal:
                with self.journal.open("a") as f:
                    for req, name in zip(requests, final):
                        f.write(json.dumps({**req.to_json(), "name": name}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            handles = self.rt.submit_many(specs)
        for name in final:
            log.info("service: accepted job %r", name)
        return final, handles

    def _resume(self) -> list[str]:
        """Resubmit the journal's jobs (not those cancelled or failed at the last shutdown)."""
        ended: dict[str, str] = {}
        try:
            ended = json.loads((self.run_dir / STATE).read_text()).get("jobs", {})
        except (OSError, ValueError, AttributeError):
            pass  # killed without a clean stop: resubmit everything, each from its checkpoint
        requests, names = [], []
        for i, line in enumerate(self.journal.read_text().splitlines()):
            if not line.strip():
                continue
            req = JobRequest.from_json(json.loads(line), f"{self.journal} line {i + 1}")
            if req.name is None:  # (the journal holds every request under its final name)
                raise RequestError(f"{self.journal} line {i + 1}: a journaled job has no name")
            if ended.get(req.name) in ("cancelled", "failed"):
                continue
            requests.append(req)
            names.append(req.name)
        if requests:
            self.submit(requests, names=names, journal=False)
        return names

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> list[str]:
        """Checkpoint every live job and close (``rt.stop(checkpoint=True)``); records each
        job's status for ``--resume``. Returns the jobs that could not be checkpointed."""
        self.server.stop()  # no new submits while stopping
        if self.grpc is not None:
            self.grpc.stop()
        if self.repository is not None:
            self.repository.close()  # no more polling
        # Read before stopping: stop() ends the unfinished jobs as cancelled too, and only those
        # the user cancelled (or that failed) must stay ended on --resume.
        before = {h.name: h.status() for h in self.rt.jobs}
        missed = self.rt.stop(checkpoint=True)
        state = {"stopped_unix_s": time.time(), "jobs": before}
        try:
            (self.run_dir / STATE).write_text(json.dumps(state, indent=2) + "\n")
            (self.run_dir / ANNOUNCE).unlink(missing_ok=True)
        except OSError as err:
            log.warning("service: could not record the job states in %s: %s", self.run_dir, err)
        return missed


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    k = 2
    while f"{name}.{k}" in taken:
        k += 1
    return f"{name}.{k}"


def _one_line(err: BaseException) -> str:
    return error_line(err, with_type=False)


__all__ = ["Service", "JOURNAL", "MODELS_JOURNAL", "STATE", "ANNOUNCE"]
