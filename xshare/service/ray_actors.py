"""Many devices through Ray (``pip install 'xshare[ray]'``): one runtime actor per device and
a sweep driver that places jobs on them with :func:`xshare.sched.placement.place`.

Ray starts, places, restarts and kills the actors; xshare only decides which actor gets each
job (DESIGN "Beyond one machine"). Each actor is a long-lived ``xshare.Runtime`` (``num_gpus=1``
on a GPU cluster; ``num_cpus`` here) that takes jobs as plain data (:mod:`.jobs`), like
``xshare serve``. Every actor writes its jobs' ``metrics.jsonl``, ``log.txt`` and checkpoints
into the run directory, which must be storage every node sees (one machine: any directory;
a cluster: a shared filesystem, like Ray's own ``storage_path``): that is how metrics reach the
run directory while the jobs run, and how a job of a dead actor resumes on another from its
last checkpoint (every actor runs with ``resume=True``; a job without a checkpoint starts at
step 0). Actors are named ``xshare-runtime-{i}`` in the ``xshare`` namespace, so that
``xshare top --ray`` finds them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .._errors import error_line
from ..jobs.request import JobRequest

log = logging.getLogger("xshare.ray")

NAMESPACE = "xshare"
ACTOR_PREFIX = "xshare-runtime-"
TERMINAL = ("done", "failed", "cancelled")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        from .._errors import XShareError

        raise XShareError("--ray needs Ray: pip install 'xshare[ray]'") from None
    return ray


class RuntimeActor:
    """The body of a runtime actor (wrapped with ``ray.remote`` by :func:`actor_class`)."""

    def __init__(self, run_dir: str, memory: Any = None, policy: str = "pack",
                 checkpoint_every: int | None = 100, fuse: bool = False, group_capacity: int | None = None):
        import xshare

        # Results are the jobs' final checkpoints under run_dir (read there, never through
        # result()): the actor keeps no done job's state in memory (as xshare serve).
        self.rt = xshare.Runtime(policy=policy, memory=memory, log_dir=run_dir, checkpoint_dir=run_dir,
                                 checkpoint_every=checkpoint_every, resume=True, fuse=fuse,
                                 group_capacity=group_capacity, keep_results=False)

    def submit(self, jobs: list[dict[str, Any]]) -> list[str]:
        """Build and submit (all or none); raises SpecError with the one-line reason."""
        requests = [JobRequest.from_json(j) for j in jobs]
        specs = [r.build(r.name) for r in requests]
        return [h.name for h in self.rt.submit_many(specs)]

    def snapshot(self) -> dict[str, Any]:
        return self.rt.snapshot()

    def cancel(self, name: str) -> None:
        """End the job at its next step boundary (a pruned trial); no-op once it has ended."""
        self.rt.cancel(name)

    def ended(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Those of ``names`` that have ended, each ``{"status", "steps_done", "error"}``, with
        their files written: a reader of ``RUN_DIR/<name>/metrics.jsonl`` after this call sees
        every row the job recorded. (A snapshot can show a job ended a moment before its last
        rows are handed to the recorder; the handle's done event is set after they are, and the
        recorder's flush waits for everything handed to it so far.)"""
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            h = self.rt.handle(name)
            if h.wait(0):
                out[name] = {"status": h.status(), "steps_done": h.progress().steps_done, "error": h.error}
        if out:
            self.rt.recorder.flush()
        return out

    def stop(self) -> list[str]:
        return self.rt.stop(checkpoint=True)


def actor_class() -> Any:
    return _ray().remote(RuntimeActor)


def actor_options(index: int, *, num_cpus: float = 1.0) -> dict[str, Any]:
    """``num_gpus=1`` where the cluster has GPUs (one runtime per device), else ``num_cpus``."""
    ray = _ray()
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    opts: dict[str, Any] = {"name": f"{ACTOR_PREFIX}{index}", "namespace": NAMESPACE, "max_restarts": 0}
    opts.update({"num_gpus": 1, "num_cpus": 0} if gpu else {"num_cpus": num_cpus})
    return opts


@dataclass
class Sweep:
    """What the driver knows of each job: where it runs, its last status, how often it moved."""

    requests: dict[str, JobRequest]
    owner: dict[str, str] = field(default_factory=dict)
    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    moves: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    footprint: dict[str, int] = field(default_factory=dict)  # entry -> a compiled job's P+S+E

    def ended(self) -> bool:
        return all(n in self.refused or self.status.get(n, {}).get("status") in TERMINAL for n in self.requests)


def run_sweep(requests: list[JobRequest], *, run_dir: str, actors: int = 2, memory: Any = None,
              policy: str = "pack", checkpoint_every: int | None = 100, fuse: bool = False,
              num_cpus: float = 1.0, poll_s: float = 0.5,
              on_poll: Callable[[Sweep, dict[str, Any]], None] | None = None) -> Sweep:
    """Run ``requests`` across ``actors`` runtime actors of the connected Ray cluster
    (``ray.init`` first). Returns the sweep's final table. A dead actor's unfinished jobs are
    placed again on the living ones and resume from their checkpoints."""
    from xshare.sched.placement import ActorView, Want, place

    ray = _ray()
    cls = actor_class()
    live: dict[str, Any] = {}
    for i in range(actors):
        opts = actor_options(i, num_cpus=num_cpus)
        live[opts["name"]] = cls.options(**opts).remote(run_dir, memory, policy, checkpoint_every, fuse)
    names = [r.name for r in requests if r.name is not None]
    if len(names) != len(requests):  # (a launch plan names every job: requests_from_plan)
        raise ValueError("run_sweep: every request needs a name; expand them with requests_from_plan")
    sweep = Sweep(requests=dict(zip(names, requests)))
    arrival = {n: i for i, n in enumerate(names)}
    pending = list(names)
    snaps: dict[str, dict[str, Any]] = {}
    try:
        while True:
            snaps = _poll(ray, live, sweep, pending)
            if pending:
                if not live:
                    for n in pending:
                        sweep.refused[n] = "every runtime actor died"
                    pending.clear()
                    break
                views = [ActorView(a, int(s["arena"]["capacity_bytes"]), int(s["arena"]["free_bytes"]))
                         for a, s in snaps.items()]
                wants = [Want(n, sweep.footprint.get(sweep.requests[n].entry),
                              sweep.requests[n].priority or 0, arrival[n]) for n in pending]
                result = place(wants, views)
                for r in result.refused:
                    sweep.refused[r.name] = r.reason
                for actor, names in result.by_actor().items():
                    try:
                        ray.get(live[actor].submit.remote([sweep.requests[n].to_json() for n in names]))
                    except ray.exceptions.RayActorError:
                        continue  # died meanwhile: these stay pending, the next poll removes it
                    except Exception as err:  # noqa: BLE001 - cannot build: refuse them, keep the rest
                        why = error_line(err, with_type=False)
                        for n in names:
                            sweep.refused[n] = why
                    else:
                        for n in names:
                            sweep.owner[n] = actor
                pending[:] = [n for n in pending if n not in sweep.owner and n not in sweep.refused]
            if on_poll is not None:
                on_poll(sweep, live)
            if not pending and sweep.ended():
                break
            time.sleep(poll_s)
    finally:
        for actor in live.values():
            try:
                ray.get(actor.stop.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - dead already, or stuck: kill it either way
                pass
            ray.kill(actor)
    return sweep


def _poll(ray: Any, live: dict[str, Any], sweep: Sweep, pending: list[str]) -> dict[str, dict[str, Any]]:
    """Every live actor's snapshot; a dead actor is dropped and its unfinished jobs go back
    to ``pending`` (they resume from their checkpoints wherever they land next)."""
    refs = {a: h.snapshot.remote() for a, h in live.items()}
    snaps: dict[str, dict[str, Any]] = {}
    for actor, ref in refs.items():
        try:
            snaps[actor] = ray.get(ref, timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            log.warning("runtime actor %s is gone (%s); moving its jobs", actor, type(err).__name__)
            del live[actor]
            for name, owner in list(sweep.owner.items()):
                if owner == actor and sweep.status.get(name, {}).get("status") not in TERMINAL:
                    del sweep.owner[name]
                    sweep.moves[name] = sweep.moves.get(name, 0) + 1
                    pending.append(name)
    for actor, snap in snaps.items():
        for job in snap["jobs"]:
            name = job["name"]
            if sweep.owner.get(name) != actor:
                continue
            sweep.status[name] = {**job, "actor": actor}
            sizes = [job.get(k) for k in ("persistent_bytes", "staging_bytes", "ephemeral_bytes")]
            if all(s is not None for s in sizes) and name in sweep.requests:
                entry = sweep.requests[name].entry
                sweep.footprint[entry] = max(sweep.footprint.get(entry, 0), sum(sizes))
    return snaps


def actor_snapshots(address: str | None = None) -> list[dict[str, Any]]:
    """``xshare top --ray``: the status document of every runtime actor of the cluster."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(ACTOR_PREFIX))
    docs = []
    for name in names:
        try:
            doc = ray.get(ray.get_actor(name, namespace=NAMESPACE).snapshot.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - an actor that died between listing and asking
            continue
        docs.append({**doc, "actor": name})
    return docs


__all__ = ["RuntimeActor", "run_sweep", "actor_snapshots", "actor_options", "Sweep", "NAMESPACE"]
