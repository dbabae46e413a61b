"""Launch specs: a TOML file or ``module:function --set k=v1,v2`` expanded into a list of jobs.

A spec names factories (``module:function``) and the parameters to call them with. Lists
under ``params`` expand to a grid, the cartesian product of every list (like Hydra multirun),
and ``replicas = N`` runs each grid point N times. Everything here is checked before any job
starts: every problem is a :class:`xshare.SpecError` whose message names the job and the fix.

Rules a user relies on (also in the README):

* ``replicas = N`` passes ``seed = 0 .. N-1`` to the factory, unless ``params`` sets ``seed``
  itself: then the N replicas are identical copies (useful to measure sharing), named
  ``replica=i``.
* To pass a list as one value instead of sweeping it, wrap it in another list:
  ``layers = [[128, 64]]``.
* Job names are ``{num}_{k=v,...}``: ``num`` counts every job of the run from 0, zero-padded
  to the width of the count; ``k=v`` lists the swept parameters (sorted by key, plus ``seed``
  or ``replica`` when ``replicas > 1``). A job table's ``name`` goes first: ``{num}_{name}_...``.
  With nothing swept and no name, the label is the entry's module name.
* ``steps`` is passed to the factory as ``steps=`` when it takes that parameter, and is set on
  the returned job in any case; ``priority`` is set on the returned job.

The package splits along the three things a spec goes through: :mod:`.parse` (the TOML and
``--set`` values, the plan's data model), :mod:`.expand` (the grid, names, the plan) and
:mod:`.resolve` (from ``module:function`` to the factory). Planning imports no jax; only
:func:`build` calls the factories.
"""

from __future__ import annotations

import inspect
from typing import Any

from xshare._errors import SpecError as SpecError

from .expand import plan_entry as plan_entry
from .expand import plan_file as plan_file
from .parse import JOB_KEYS as JOB_KEYS
from .parse import RUNTIME_KEYS as RUNTIME_KEYS
from .parse import TOP_KEYS as TOP_KEYS
from .parse import LaunchPlan as LaunchPlan
from .parse import Overrides as Overrides
from .parse import PlannedJob as PlannedJob
from .parse import RuntimeOptions as RuntimeOptions
from .parse import parse_set as parse_set
from .parse import parse_value as parse_value
from .parse import plan_from_json as plan_from_json
from .parse import policies as policies
from .resolve import check_params as check_params
from .resolve import resolve_entry as resolve_entry
from .resolve import signature as signature


def build(job: PlannedJob) -> Any:
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
