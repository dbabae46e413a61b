"""``xshare serve`` under concurrent clients: threads submit random jobs over HTTP and pause,
resume, re-prioritize and cancel each other's jobs while they run. Every control is answered
200, or 409 for a job that has ended; no job fails; every job that finished ends in exactly the
state ``xshare.run`` reaches for the same requests in one process."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from xshare.jobs import JobRequest

from .conftest import TINY, Served
from .test_serve import assert_same_tree, final_state, in_process


def clients(served: Served, seed: int) -> None:
    r = random.Random(seed)
    names: list[str] = []
    requests: dict[str, JobRequest] = {}
    refused: list = []
    lock = threading.Lock()

    def client(c: int) -> None:
        cr = random.Random(seed * 10 + c)
        for q in range(cr.randint(2, 5)):
            batch = [JobRequest("xshare.models.mlp:make_job",
                                {**TINY, "lr": cr.choice([1e-3, 3e-3]), "seed": cr.randint(0, 5)},
                                steps=cr.randint(1, 2000), name=f"s{seed}c{c}q{q}j{i}") for i in range(cr.randint(1, 3))]
            code, doc = served.http("POST", "/jobs", json.dumps({"jobs": [b.to_json() for b in batch]}).encode())
            if code != 200:
                refused.append(("submit", code, doc))
                continue
            with lock:
                for b, j in zip(batch, doc["jobs"]):
                    names.append(j["name"])
                    requests[j["name"]] = b
            for _ in range(cr.randint(0, 4)):
                with lock:
                    target = cr.choice(names)
                what = cr.choice(["pause", "resume", "resume", "priority", "cancel"])
                body = json.dumps({"priority": cr.randint(-3, 3)}).encode() if what == "priority" else b""
                code, doc = served.http("POST", f"/jobs/{target}/{what}", body)
                if code not in (200, 409):  # (409: it ended meanwhile)
                    refused.append((what, code, doc))
            time.sleep(cr.uniform(0, 0.05))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(r.randint(2, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not refused, refused
    for name in names:  # (a job left paused would never end)
        served.http("POST", f"/jobs/{name}/resume", b"")
    jobs = served.wait_for(lambda js: all(js[n]["status"] in ("done", "cancelled", "failed") for n in names),
                           timeout=300, what="every job to end")
    assert not [n for n in names if jobs[n]["status"] == "failed"], jobs
    done = [n for n in names if jobs[n]["status"] == "done"]
    expected, specs = in_process([requests[n] for n in done])
    for name, spec in zip(done, specs):
        assert_same_tree(final_state(served.run_dir, name, spec.state).state, expected[name][0], name)


def test_concurrent_clients_submitting_and_controlling_jobs(served: Served):
    clients(served, 1)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "pack", "srtf", "fair", "priority"])
def test_concurrent_clients_under_every_policy(policy, tmp_path):
    served = Served(tmp_path, "--policy", policy)
    try:
        for seed in range(3):
            clients(served, 100 + seed)
    finally:
        served.stop()
