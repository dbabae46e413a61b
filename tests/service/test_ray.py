"""Many devices through Ray: 2 CPU runtime actors run a 16-job sweep with the results of one
runtime; killing an actor mid-run loses no job (its jobs resume from checkpoints elsewhere)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'xshare[ray]')")

import xshare  # noqa: E402
from xshare.runtime.observe import checkpoint  # noqa: E402
from xshare.jobs.request import JobRequest  # noqa: E402
from xshare.service.ray_actors import run_sweep  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 300
LONG = 2000  # the kill test's jobs: long enough that the kill lands mid-run on a 2-core machine


def sweep_requests(n: int = 16, steps: int = STEPS) -> list[JobRequest]:
    lrs = (1e-3, 3e-3, 1e-2, 3e-4)
    return [JobRequest("xshare.models.mlp:make_job", {"width": 16, "batch": 8, "lr": lrs[i % 4], "seed": i // 4},
                       steps=steps, name=f"{i:02d}_job") for i in range(n)]


def single_runtime(steps: int = STEPS):
    requests = sweep_requests(steps=steps)
    specs = [r.build(r.name) for r in requests]
    results = xshare.run(specs, memory="256MiB")
    return {r.name: (spec, state) for r, spec, (state, _) in zip(requests, specs, results)}


def check_results(run_dir, sweep, single_runtime, steps=STEPS):
    for name, (spec, state) in single_runtime.items():
        assert sweep.status[name]["status"] == "done", (name, sweep.status.get(name), sweep.refused.get(name))
        assert sweep.status[name]["steps_done"] == steps, name
        saved = checkpoint.load(checkpoint.path_for(run_dir, name), spec.state, job=name)
        assert saved is not None and saved.done and saved.step == steps, name
        for a, b in zip(jax.tree.leaves(saved.state), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        rows = [json.loads(line)["step"] for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        assert rows == list(range(steps)), f"{name}: metrics rows missing, repeated or out of order after a move"


def test_sweep_on_two_actors_equals_one_runtime(local_ray, tmp_path, capsys):
    from xshare.cli.main import main

    seen: dict[str, set] = {}

    def top_ray(sweep, live):  # `xshare top --ray --json` while the sweep runs
        if seen or not sweep.owner:
            return
        assert main(["top", "--ray", "--json"]) == 0
        for doc in json.loads(capsys.readouterr().out)["runtimes"]:
            seen[doc["actor"]] = {j["name"] for j in doc["jobs"]}

    sweep = run_sweep(sweep_requests(), run_dir=str(tmp_path), actors=2, memory="256MiB", checkpoint_every=50,
                      on_poll=top_ray)
    assert set(seen) == {"xshare-runtime-0", "xshare-runtime-1"}
    assert set().union(*seen.values()) == set(sweep.requests)  # every actor's jobs, all of them
    assert not sweep.refused
    assert set(sweep.owner.values()) == {"xshare-runtime-0", "xshare-runtime-1"}  # both actors got work
    check_results(tmp_path, sweep, single_runtime())


def test_killing_an_actor_loses_no_job(local_ray, tmp_path):
    killed: list[str] = []

    def kill_one_mid_run(sweep, live):
        if killed or "xshare-runtime-0" not in live:
            return
        mine = [n for n, a in sweep.owner.items() if a == "xshare-runtime-0"]
        steps = [sweep.status.get(n, {}).get("steps_done", 0) for n in mine]
        if any(s >= 200 for s in steps) and not all(s >= LONG for s in steps):
            ray.kill(live["xshare-runtime-0"])  # like a lost node: no chance to checkpoint
            killed.append("xshare-runtime-0")

    sweep = run_sweep(sweep_requests(steps=LONG), run_dir=str(tmp_path), actors=2, memory="256MiB",
                      checkpoint_every=50, poll_s=0.05, on_poll=kill_one_mid_run)
    assert killed, "the sweep ended before an actor could be killed mid-run"
    moved = [n for n, k in sweep.moves.items() if k]
    assert moved and all(sweep.owner[n] == "xshare-runtime-1" for n in moved)
    assert not sweep.refused
    check_results(tmp_path, sweep, single_runtime(LONG), LONG)
