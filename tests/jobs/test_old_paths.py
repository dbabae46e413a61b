"""The spec model moved from ``xshare.cli.spec`` and ``xshare.service.jobs`` to ``xshare.jobs``
(below the CLI, the service, tune and the benchmarks); the old import paths name the very same
objects, so users' imports and their patches keep working."""

from __future__ import annotations

import xshare.cli.spec as old_spec
import xshare.jobs as jobs
import xshare.service.jobs as old_service_jobs


def test_old_spec_paths_are_the_same_objects():
    from xshare.cli.spec.parse import PlannedJob, safe
    from xshare.cli.spec.resolve import resolve_entry

    assert PlannedJob is jobs.PlannedJob and safe is jobs.parse.safe
    assert resolve_entry is jobs.resolve_entry
    assert old_spec.build is jobs.build and old_spec.plan_entry is jobs.plan_entry
    for name in ("parse", "expand", "resolve", "search"):
        assert getattr(old_spec, name) is getattr(jobs, name)


def test_old_service_jobs_path_is_the_request_module():
    assert old_service_jobs.JobRequest is jobs.JobRequest
    assert old_service_jobs.RequestError is jobs.RequestError
    assert set(old_service_jobs.__all__) <= set(dir(old_service_jobs))


def test_a_request_plans_and_names_like_launch_through_either_path():
    # The same entry expanded by the new and the old path: same names, params and steps.
    new = jobs.plan_entry("xshare.models.mlp:make_job", jobs.Overrides(sets={"lr": [1e-3, 3e-4]}, steps=5))
    old = old_service_jobs.plan_target("xshare.models.mlp:make_job", ["lr=1e-3,3e-4"], steps=5)
    assert [j.to_json() for j in new.jobs] == [j.to_json() for j in old.jobs]
    assert [j.name for j in new.jobs] == ["0_lr=0.001", "1_lr=0.0003"]
