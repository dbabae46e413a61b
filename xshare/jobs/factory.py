"""From a planned job to the bound job it names: the one place a factory is called."""

from __future__ import annotations

import inspect
from typing import Any

from xshare._errors import SpecError

from .parse import LaunchPlan
from .request import JobRequest
from .resolve import check_params, resolve_entry


def build(job: JobRequest) -> Any:
    """Call the job's factory and name the bound job (an ``xshare.JobSpec``) it returns.
    Raises SpecError on any problem. Imports the factory's module (and so, usually, jax)."""
    from xshare._job import Job, JobSpec

    fn = resolve_entry(job.entry, job.who)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: nothing to check before calling
        sig = None
    takes_steps = check_params(sig, job.params, job.who)
    kwargs = dict(job.params)
    if takes_steps and job.steps is not None:
        kwargs["steps"] = job.steps
    try:
        spec = fn(**kwargs)
    except Exception as err:
        raise SpecError(f"{job.who}: the factory raised {type(err).__name__}: {err}") from err
    if isinstance(spec, Job):
        raise SpecError(f"{job.who}: the factory returned the step itself; return step.bind(state, data, steps=...) instead")
    if not isinstance(spec, JobSpec):
        raise SpecError(
            f"{job.who}: the factory returned {type(spec).__name__}, not a bound job; "
            "it must return step.bind(state, data, steps=...) of an @xshare.job step"
        )
    meta = {**spec.meta, "entry": job.entry, "params": dict(job.params)}  # shown by status and `xshare top`
    changes: dict[str, Any] = {"name": job.name, "meta": meta}
    if job.steps is not None:
        changes["steps"] = job.steps
    if job.priority is not None:
        changes["priority"] = job.priority
    return spec.replace(**changes)


def build_all(plan: LaunchPlan) -> list[Any]:
    return [build(job) for job in plan.jobs]
