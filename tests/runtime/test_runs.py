"""Runs: a job's turn makes several calls of its one-step program (``Executor.run``).

The calls and their operands are the ones one step per turn makes, in the same order, so a job
ends as the plain loop does bit for bit; a run never passes a boundary (the job's last step, a
report ``on_metrics`` acts on, an evaluation, a bad batch), and on an accelerator the job's
steps in flight stay within what its footprint is charged for. ``steps_per_call=1`` keeps every
call one step (no K-step program), so what is counted here is runs alone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import xshare
from xshare.runtime.engine.executor import Executor
from xshare.runtime.engine.multicall import RUN_STEPS
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop


@pytest.fixture
def runs(monkeypatch):
    """Every run as (its first step, its length) (the real method runs; its arguments are
    recorded)."""
    seen: list[tuple[int, int]] = []
    real = Executor.run

    def run(self, job, li, pos, n):
        seen.append((job.dispatched, n))
        return real(self, job, li, pos, n)

    monkeypatch.setattr(Executor, "run", run)
    return seen


def make(seed: int, steps: int, **kw):
    return linreg_step.bind(linreg_state(seed=seed), linreg_data(seed=seed), steps=steps, name=f"r{seed}", **kw)


@pytest.mark.parametrize("policy", ["fifo", "pack", "fair", "priority"])
def test_one_step_calls_run_several_a_turn_and_end_as_the_plain_loop(runs, policy):
    # (Under priority a run is capped at ~QUANTUM_S of device time shared by the calls in flight,
    # from the job's measured step time, an average that starts with a first call's one-time
    # costs: runs begin once it has settled.)
    steps = 600 if policy == "priority" else 150
    specs = [make(i, steps) for i in range(3)]
    with xshare.Runtime(memory="256MiB", policy=policy, steps_per_call=1) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        per_call = [h["steps_per_call"] for h in rt.snapshot()["jobs"]]
    lengths = [n for _, n in runs]
    assert lengths and max(lengths) <= RUN_STEPS, runs
    assert sum(lengths) > (0.5 if policy == "priority" else 0.8) * 3 * steps, (sum(lengths), runs)
    assert per_call == [{"1": steps}] * 3, per_call  # one step per call, every call
    for spec, h in zip(specs, handles):
        state, metrics = h.result()
        ref_state, ref_metrics = plain_loop(spec)
        assert_trees_equal(state, ref_state)
        assert metrics["loss"] == pytest.approx(float(ref_metrics["loss"]), rel=0, abs=0)


def test_a_run_stops_at_every_report_on_metrics_acts_on(runs):
    seen: list[tuple[int, float]] = []
    spec = dataclasses.replace(make(0, 100), on_metrics=lambda step, m: seen.append((step, m["loss"])),
                               on_metrics_every=7)
    with xshare.Runtime(memory="256MiB", policy="fifo", steps_per_call=1) as rt:
        h = rt.submit(spec)
        rt.wait()
    assert runs and all(n > 1 for _, n in runs), runs
    for start, n in runs:  # no run passes a report: steps 7, 14, ... each end one
        assert start // 7 == (start + n - 1) // 7, runs
    # Every step's own metrics reach on_metrics, in order, as the plain loop computes them.
    state, step = jax.tree.map(lambda x: jnp.array(x, copy=True), spec.state), jax.jit(spec.fn)
    want = []
    for k in range(100):
        state, metrics = step(state, spec.data(k))
        want.append((k + 1, float(metrics["loss"])))
    assert seen == want
    assert_trees_equal(h.result()[0], jax.device_get(state))


@pytest.mark.parametrize("kind", ["wrong width", "raises"])
def test_a_bad_batch_ends_the_run_before_it_and_fails_its_job_alone(runs, kind):
    good = linreg_data(seed=1)

    def data(step):
        batch = good(step)
        if step == 37 and kind == "raises":
            raise RuntimeError("no batch 37")
        return {"x": batch["x"][:, :5], "y": batch["y"]} if step == 37 else batch

    bad = linreg_step.bind(linreg_state(seed=1), data, steps=80, name="bad")
    other = make(2, 80)
    # (fifo: the bad job alone, so the run before batch 37 is still in flight when it fails)
    with xshare.Runtime(memory="256MiB", policy="fifo", steps_per_call=1) as rt:
        hb, ho = rt.submit_many([bad, other])
        rt.wait()
        done = {j["name"]: j["steps_done"] for j in rt.snapshot()["jobs"]}
    why = "batch 37 does not match" if kind == "wrong width" else "producing batch 37: RuntimeError: no batch 37"
    assert hb.status() == "failed" and why in hb.error, hb.error
    # Every step before the bad batch ran, and counted (the runs before it still in flight
    # when the job failed too).
    assert done["bad"] == 37, done
    assert_trees_equal(ho.result()[0], plain_loop(other)[0])


def test_off_a_cpu_a_jobs_steps_in_flight_stay_within_what_its_footprint_is_charged_for(monkeypatch):
    """(On a CPU a run is one pipeline entry, as a K-step call is; elsewhere each run's batches
    are device buffers until its calls end: the bound is checked with the CPU's freedom off.)"""
    ahead = 3
    worst: list[int] = []
    real = Executor.run

    def run(self, job, li, pos, n):
        real(self, job, li, pos, n)
        worst.append(self.steps_in_flight(job))

    monkeypatch.setattr(Executor, "run", run)
    spec = make(3, 120)
    with xshare.Runtime(memory="256MiB", policy="fifo", steps_per_call=1, dispatch_ahead=ahead) as rt:
        rt._dispatcher.executor.runs_free = False
        h = rt.submit(spec)
        rt.wait()
    assert worst and max(worst) <= ahead + 1, worst
    assert_trees_equal(h.result()[0], plain_loop(spec)[0])



def test_a_run_takes_about_run_s_of_a_jobs_steps():
    """Small steps run 16 a turn; steps of RUN_S or more run one a turn, so jobs of long steps
    that share a lane alternate step by step as they did before runs."""
    from xshare.runtime.engine.multicall import RUN_S, run_steps

    assert run_steps(50e-6) == RUN_STEPS == 16
    assert run_steps(RUN_S / 4) == 4
    assert run_steps(RUN_S) == run_steps(4 * RUN_S) == 1
    assert run_steps(0.0) == RUN_STEPS  # (a step the fences timed at 0 ns)


def test_a_fused_groups_turn_runs_several_group_steps_and_its_members_end_as_the_vmapped_loop(monkeypatch):
    """A fused group at one step per call runs several group steps a turn, once its fusion is
    settled and its steps measured: every member ends as the same vmapped loop."""
    from tests.runtime.test_fusion import vmapped_loop
    from xshare.runtime.engine.multigroup import GroupCalls

    lengths: list[int] = []
    real = GroupCalls.run

    def run(self, group, li, pos, n):
        lengths.append(n)
        return real(self, group, li, pos, n)

    monkeypatch.setattr(GroupCalls, "run", run)
    specs = [make(i, 200) for i in range(3)]
    with xshare.Runtime(memory="256MiB", fuse="always", steps_per_call=1) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        snap = rt.snapshot()
    assert snap["runtime"]["fused_member_steps"] == 3 * 200, snap["runtime"]
    assert lengths and max(lengths) <= RUN_STEPS and sum(lengths) > 100, lengths
    assert all(j["steps_per_call"] == {"1": 200} for j in snap["jobs"]), [j["steps_per_call"] for j in snap["jobs"]]
    for h, want in zip(handles, vmapped_loop(specs, 4, 200)):
        assert_trees_equal(h.result()[0], want)
