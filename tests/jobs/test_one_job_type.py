"""One "job as plain data" type: a launch plan's jobs, the service's and Ray's requests and the
benchmarks' plans are all ``xshare.jobs.JobRequest`` (issue #31: it used to be three classes)."""

from __future__ import annotations

import re

import pytest

from xshare import jobs
from xshare.bench import harness
from xshare.jobs import JobRequest, RequestError

ENTRY = "xshare.models.mlp:make_job"


def test_a_plans_jobs_are_requests_that_cross_json_unchanged():
    plan = jobs.plan_entry(ENTRY, jobs.Overrides(sets={"lr": [1e-3, 3e-4]}, steps=5))
    assert all(type(j) is JobRequest for j in plan.jobs)
    assert jobs.PlannedJob is JobRequest
    job = plan.jobs[0]
    assert job.origin == "command line" and job.who == f"job 0_lr=0.001 (command line, {ENTRY})"
    again = JobRequest.from_json(job.to_json())
    assert again == job and again.origin == "submitted job"  # where it came from is not the job
    assert jobs.requests_from_plan(plan) == list(plan.jobs)


def test_the_launch_record_keeps_every_key():
    # spec.json and --dry-run --json: null steps and priority stay in the record (a request's
    # own JSON leaves them out); --resume reads the record back into the same jobs.
    plan = jobs.plan_entry(ENTRY, jobs.Overrides(sets={"width": 16}))
    record = plan.to_json()
    assert list(record["jobs"][0]) == ["name", "entry", "params", "steps", "priority"]
    assert record["jobs"][0]["priority"] is None
    back = jobs.plan_from_json(record, "spec.json")
    assert back.jobs == plan.jobs


def test_the_benchmarks_plans_are_requests():
    plan = harness.JobPlan("j0", ENTRY, {"width": 16}, 3)
    assert plan == JobRequest(entry=ENTRY, params={"width": 16}, steps=3, name="j0")
    assert plan.origin == "benchmark"
    assert [p.name for p in harness.expand(ENTRY, {"lr": [1e-3, 3e-4]}, 2, prefix="a")] == \
        ["a0_lr=0.001", "a1_lr=0.0003"]


def test_a_spec_job_must_be_plain_data_too(tmp_path):
    # A planned job is checked like a submitted one: a NaN cannot be recorded as JSON.
    spec = tmp_path / "nan.toml"
    spec.write_text(f'[[job]]\nentry = "{ENTRY}"\nparams = {{ lr = nan }}\n')
    with pytest.raises(RequestError, match=re.escape(
            "params.lr = nan: JSON has no NaN or infinity; pass a finite number")):
        jobs.plan_file(spec)
