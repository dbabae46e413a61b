"""Evaluation during training: ``bind(..., eval_step=, eval_data=, eval_every=)``.

Eval metrics land every K steps and at the end (metrics.jsonl, progress, /metrics); they are
computed on the state after exactly that step; evaluation never changes the final state (bit
for bit against the same job without eval and a plain jit loop, solo and fused); bad arguments
are refused at bind; ``on_metrics`` returning True cancels at that step boundary.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from xshare.cli.main import main
from tests.runtime.test_fusion import vmapped_loop
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop
from tests.status import request, runtime_dir  # noqa: F401
from tests.status.test_api import parse_prometheus, samples

STEPS, K = 23, 5
EVAL_AT = [4, 9, 14, 19, 22]  # the step index each evaluation follows: every K, and the end


def linreg_eval(state, batch):
    err = batch["x"] @ state["w"] - batch["y"]
    # "n" is the step counter in the state: it says which state was evaluated, exactly.
    return {"mse": jnp.mean(err ** 2), "n": state["n"].astype(jnp.float32)}


VAL = [linreg_data(seed=99)(k) for k in range(3)]


def spec(name, seed=0, **kw):
    kw = {"eval_step": linreg_eval, "eval_data": VAL, "eval_every": K, **kw}
    return linreg_step.bind(linreg_state(seed=seed), linreg_data(seed=seed), steps=STEPS, name=name, **kw)


def reference_eval(state):
    values = [jax.device_get(jax.jit(linreg_eval)(state, b)) for b in VAL]
    return {f"eval/{k}": float(np.mean([v[k] for v in values])) for k in values[0]}


def rows(log_dir, name):
    return [json.loads(line) for line in open(log_dir / name / "metrics.jsonl")]


@pytest.mark.parametrize("fuse", [False, True], ids=["solo", "fused"])
def test_eval_every_k_steps_and_at_the_end_without_changing_the_state(tmp_path, fuse):
    with xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path, fuse=fuse) as rt:
        with_eval = rt.submit_many([spec(f"e{i}", seed=i) for i in range(3)])
        without = rt.submit_many([spec(f"p{i}", seed=i, eval_step=None, eval_data=None, eval_every=None)
                                  for i in range(3)])
        rt.wait()
    for h in with_eval + without:
        assert h.status() == "done", h.error
    for i, (a, b) in enumerate(zip(with_eval, without)):
        # Evaluation reads the state and never changes it: bit for bit the run without it ...
        assert_trees_equal(a.result()[0], b.result()[0])
        evals = [r for r in rows(tmp_path, f"e{i}") if "eval/mse" in r]
        assert [r["step"] for r in evals] == EVAL_AT
        # ... and each evaluation saw the state right after its step.
        assert [r["eval/n"] for r in evals] == [s + 1 for s in EVAL_AT]
        assert not any("eval/mse" in r for r in rows(tmp_path, f"p{i}"))
        final = a.progress().metrics
        assert final["eval/n"] == STEPS and "loss" in final
        np.testing.assert_allclose(final["eval/mse"], reference_eval(a.result()[0])["eval/mse"], rtol=1e-5)
    if fuse:
        refs = vmapped_loop([spec(f"r{i}", seed=i) for i in range(3)], 4, STEPS)
        for h, want in zip(with_eval, refs):
            assert_trees_equal(h.result()[0], want)  # a fused member: the plain vmapped loop
    else:
        for i, h in enumerate(with_eval):
            assert_trees_equal(h.result()[0], plain_loop(spec(f"r{i}", seed=i))[0])


def test_eval_metrics_reach_status_prometheus_and_top(runtime_dir, capsys, monkeypatch):
    with xshare.Runtime(policy="pack", memory="64MiB", status_port=0) as rt:
        h = rt.submit(spec("served"))
        rt.wait()
        code, _, body = request(rt.status_server.address, "GET", "/metrics")
        doc = rt.snapshot()
        monkeypatch.setenv("COLUMNS", "200")
        assert main(["top", "--once"]) == 0
    assert re.search(r"served .* eval/mse \d", capsys.readouterr().out)
    assert h.status() == "done", h.error
    assert code == 200
    job = next(j for j in doc["jobs"] if j["name"] == "served")
    assert job["metrics"]["eval/n"] == STEPS
    values = samples(parse_prometheus(body.decode())["xshare_job_metric"])
    assert values[(("job_name", "served"), ("metric", "eval/n"))] == STEPS
    assert (("job_name", "served"), ("metric", "eval/mse")) in values


def test_data_that_ends_gets_its_evaluation_at_the_end(tmp_path):
    data = [linreg_data()(k) for k in range(7)]
    s = linreg_step.bind(linreg_state(), data, name="ends", eval_step=linreg_eval, eval_data=VAL, eval_every=5)
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path) as rt:
        h = rt.submit(s)
        rt.wait()
    assert h.status() == "done", h.error
    assert [r["step"] for r in rows(tmp_path, "ends") if "eval/n" in r] == [4, 6]
    assert h.progress().metrics["eval/n"] == 7


def test_on_metrics_true_cancels_at_that_step_boundary():
    seen = []

    def hook(step, metrics):
        seen.append((step, dict(metrics)))
        return "eval/n" in metrics and metrics["eval/n"] >= 10  # stop after the 2nd evaluation

    s = spec("stopped", eval_every=5).replace(steps=10_000, on_metrics=hook)
    with xshare.Runtime(memory="64MiB") as rt:
        h = rt.submit(s)
        rt.wait()
    assert h.status() == "cancelled"
    # An evaluation is read with nothing of its job in flight after it: it stops right there.
    assert h.progress().steps_done == 10
    assert [m["eval/n"] for _, m in seen if "eval/n" in m] == [5.0, 10.0]
    assert [st for st, m in seen if "loss" in m] == list(range(1, 11))


def test_a_failing_eval_fails_its_job_alone():
    class Bad:
        def __iter__(self):
            yield VAL[0]
            if self.calls:
                raise RuntimeError("disk gone")
            self.calls += 1
        calls = 0

    bad = spec("bad", eval_data=Bad())
    with xshare.Runtime(memory="64MiB") as rt:
        hb, hg = rt.submit_many([bad, spec("good")])
        rt.wait()
    assert hb.status() == "failed"
    assert "its eval_data raised" in hb.error and "disk gone" in hb.error
    assert hg.status() == "done", hg.error


@pytest.mark.parametrize("kwargs, message", [
    ({"eval_data": None}, "eval_step was given without eval_data; pass eval_data=[batch, ...]"),
    ({"eval_step": None}, "eval_data was given without eval_step"),
    ({"eval_every": 0}, "eval_every=0 must be a positive int"),
    ({"eval_every": 2.5}, "eval_every=2.5 must be a positive int"),
    ({"eval_data": iter(VAL)}, "eval_data is a one-shot iterator (list_iterator)"),
    ({"eval_data": []}, "eval_data has no batches"),
    ({"eval_step": lambda s, b: {"err": b["x"] @ s["w"]}},
     "eval_step's metric 'err' has shape (16, 1); each metric must be a scalar"),
    ({"eval_step": lambda s, b: {}}, "eval_step returned no metrics"),
])
def test_bind_refuses_bad_eval_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spec("x", **kwargs)


def test_a_jobs_evaluation_is_read_while_the_other_jobs_step():
    """The dispatcher does not wait on one job's evaluation results: another job steps until
    they are there. The held job's eval_step computes for a while (matmuls on its batch), and
    the busy job keeps reporting steps through ``on_metrics`` meanwhile (the dispatcher retires
    them): no gap between two of its reports comes near the evaluation's length. Read at once,
    as before, the dispatcher sat in that host sync: a gap as long as the evaluation."""
    import threading
    import time

    w = jnp.asarray(np.random.default_rng(0).normal(size=(512, 512)) / 24.0, jnp.float32)

    def heavy_eval(state, batch):
        m = jax.lax.fori_loop(0, 60, lambda i, m: jnp.tanh(m @ w), w * batch["x"][0, 0])
        return {"n": state["n"].astype(jnp.float32) + 0.0 * m[0, 0]}

    probe = jax.jit(heavy_eval)
    jax.block_until_ready(probe(linreg_state(), VAL[0]))
    t = time.monotonic()
    jax.block_until_ready(probe(linreg_state(), VAL[0]))
    eval_s = time.monotonic() - t  # one evaluation, alone

    reports: list[float] = []
    lock = threading.Lock()

    def seen(step, metrics):
        with lock:
            reports.append(time.monotonic())
        return False

    held = linreg_step.bind(linreg_state(seed=0), linreg_data(seed=0), steps=30, name="held",
                            eval_step=heavy_eval, eval_data=VAL[:1], eval_every=10)
    busy = linreg_step.bind(linreg_state(seed=1), linreg_data(seed=1), steps=1_000_000, name="busy").replace(
        on_metrics=seen, on_metrics_every=1)
    with xshare.Runtime(policy="pack", memory="256MiB") as rt:
        b = rt.submit(busy)
        while b.progress().steps_done < 20:
            time.sleep(0.005)
        h = rt.submit(held)
        while h.status() not in ("done", "failed", "cancelled"):
            time.sleep(0.01)
        t_end = time.monotonic()
        b.cancel()
        rt.wait()
    assert h.status() == "done", h.error
    assert h.progress().metrics["eval/n"] == 30
    with lock:
        during = [r for r in reports if r <= t_end][-400:]
    gaps = np.diff(during)
    assert eval_s > 0.05 and len(gaps) > 20, (eval_s, len(gaps))
    assert gaps.max() < eval_s / 2, (gaps.max(), eval_s)


def fused_twice(tmp_path, make_specs):
    """Run ``make_specs()`` fused twice: the first run compiles the vmapped eval program in the
    background (waited for here), the second evaluates with it. Returns the two runs' handles
    and the vmapped passes the second ran."""
    import time

    from xshare.runtime.compiled import eval_programs
    from xshare.runtime.engine import evaluation

    def run(log):
        with xshare.Runtime(policy="pack", memory="256MiB", log_dir=log, fuse="always") as rt:
            handles = rt.submit_many(make_specs())
            rt.wait()
        return handles

    first = run(tmp_path / "a")
    futures = [f for p in eval_programs._MEMO[linreg_eval].values() for f in p._stacked.values()]
    deadline = time.monotonic() + 120
    while futures and not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert futures and all(f.exception() is None for f in futures)
    before = evaluation.group_passes
    second = run(tmp_path / "b")
    return first, second, evaluation.group_passes - before


def assert_evaluated_alike(tmp_path, first, second, name, at):
    """The second run's member ``name``: done, the same final state as the first (the state never
    depends on how it was evaluated), evaluated after exactly the steps ``at`` on the state right
    after each, within float tolerance of the first run's evaluations."""
    assert second.status() == "done", second.error
    assert_trees_equal(first.result()[0], second.result()[0])
    ra = [r for r in rows(tmp_path / "a", name) if "eval/mse" in r]
    rb = [r for r in rows(tmp_path / "b", name) if "eval/mse" in r]
    assert [r["step"] for r in rb] == at and [r["eval/n"] for r in rb] == [s + 1 for s in at]
    np.testing.assert_allclose([r["eval/mse"] for r in rb], [r["eval/mse"] for r in ra], rtol=1e-5)


def test_fused_members_share_one_vmapped_evaluation(tmp_path):
    first, second, passes = fused_twice(tmp_path, lambda: [spec(f"v{i}", seed=i) for i in range(3)])
    assert passes >= len(EVAL_AT)  # every evaluation shared
    for i, (a, b) in enumerate(zip(first, second)):
        assert_evaluated_alike(tmp_path, a, b, f"v{i}", EVAL_AT)


def test_a_fused_member_that_owes_its_evaluation_alone_runs_the_vmapped_pass(tmp_path):
    """A study's trials join their group at different steps, so their evaluations seldom fall
    together: a member owing one alone runs the vmapped pass over its group's stack too, not a
    copy of the whole stack to the host after every group step in flight. Members evaluated
    every 4 and every 6 steps meet only at 12 and at the end."""
    everies = (4, 6)
    first, second, passes = fused_twice(
        tmp_path, lambda: [spec(f"w{i}", seed=i, eval_every=every) for i, every in enumerate(everies)])
    at = {every: [s for s in range(STEPS) if (s + 1) % every == 0 or s == STEPS - 1] for every in everies}
    # one pass per evaluation step of either member, the shared ones once (12 and the end); the
    # first evaluation may come before the group's first step (its stack still on the host)
    needed = len(set(at[4]) | set(at[6]))
    assert passes >= needed - 1, (passes, needed)
    for i, every in enumerate(everies):
        assert_evaluated_alike(tmp_path, first[i], second[i], f"w{i}", at[every])
