"""Several steps per executable call (runtime/compiled/multistep.py, tiers.py, multicall.py): a job moved
to its K-step program ends bit-identical to the plain loop, every step's metrics included, under
every policy; a K-step form that is not bit-identical is never kept; boundaries bound K."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

import xshare
from xshare.models import cnn, digits, mlp, transformer
from xshare.runtime.compiled import multistep
from xshare.runtime.compiled.multistep import FORMS, Form
from tests.helpers import (assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop,
                           run_until_k_steps)
from tests.users.harness import MULTI_STEPS, check_multistep

SLOW = pytest.mark.slow  # compiles of convolutions, attention and a K-step scan of them: ~20 s each
ZOO = {
    "mlp": lambda steps: mlp.make_job(width=32, depth=2, batch=16, steps=steps, seed=3),
    "cnn": lambda steps: cnn.make_job(channels=4, blocks=1, batch=8, steps=steps, seed=3),
    "transformer": lambda steps: transformer.make_job(d_model=16, layers=1, heads=2, seq=16, batch=4,
                                                      steps=steps, seed=3),
    "digits": lambda steps: digits.make_job(width=16, batch=32, steps=steps, eval_every=None, seed=3),
}


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=SLOW),
                                   pytest.param("transformer", marks=SLOW), pytest.param("digits", marks=SLOW)])
def test_every_zoo_model_bit_identical_at_k_steps_per_call_under_every_policy(model):
    make = ZOO[model]
    ref_state, _ = plain_loop(make(MULTI_STEPS))
    nnx_job = model != "digits"  # the zoo's others are xshare.nnx jobs: their result is objects
    check_multistep(make, ref_state, (lambda objects: nnx.state(objects)) if nnx_job else (lambda s: s))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_steps_metrics_row_and_the_final_state_match_the_plain_loop(tmp_path):
    """Rows come back stacked from a K-step call and are recorded one per step, in order."""
    steps = 64

    def make():
        return linreg_step.bind(linreg_state(seed=5), linreg_data(seed=5), steps=steps, name="lin")

    handle = run_until_k_steps(8, make, memory="256MiB", steps_per_call=8, log_root=tmp_path)
    tier = handle._rec.tier
    assert tier.steps_at.get(8, 0) >= 16, tier.steps_at
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])
    # The plain loop's losses, step by step.
    spec = make()
    f = jax.jit(spec.fn, donate_argnums=0)
    state, losses = jax.tree.map(np.array, spec.state), []
    for k in range(steps):
        state, m = f(state, spec.data(k))
        losses.append(np.float32(m["loss"]))
    rows = _rows(max(tmp_path.glob("run*")) / "lin" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    assert [np.float32(r["loss"]) for r in rows] == losses


def test_without_a_reader_of_each_row_a_k_step_job_counts_its_steps_and_keeps_its_last_metrics():
    """No observer, on_metrics, log or nan_policy="fail": a K-step call's rows are counted at
    once (``Executor._counted``), and the job still ends with every step counted and the last
    step's metrics, as the plain loop's."""
    steps = 61  # (not a multiple of 8: the last call is shorter)

    def make():
        return linreg_step.bind(linreg_state(seed=6), linreg_data(seed=6), steps=steps, name="quiet")

    handle = run_until_k_steps(8, make, memory="256MiB", steps_per_call=8)
    assert handle._rec.tier.steps_at.get(8, 0) >= 16, handle._rec.tier.steps_at
    state, metrics = handle.result()
    want_state, want_metrics = plain_loop(make())
    assert_trees_equal(state, want_state)
    assert handle.progress().steps_done == steps
    assert metrics == {k: float(v) for k, v in want_metrics.items()}


def test_a_form_that_is_not_bit_identical_is_never_kept(monkeypatch):
    """The check compares K single steps with the K-step call from one state: a K-step program
    that computes anything else (here: one whose steps add 1e-6 to the state) is not kept, the
    job stays at one step per call and ends exact, and the reason is recorded."""
    _perturbed_compiles(monkeypatch, 1e-6)

    def make():
        return linreg_step.bind(linreg_state(dim=6, seed=9), linreg_data(dim=6, seed=9), steps=80, name="p")

    for _ in range(2):  # the first compiles in the background, the second checks
        # (compilation_cache=False: this test's verdict must not reach the verdicts kept on disk)
        with xshare.Runtime(memory="256MiB", steps_per_call=4, compilation_cache=False) as rt:
            handle = rt.submit(make())
            rt.wait()
            rt._tier_pool.shutdown(wait=True)
    tier = handle._rec.tier
    assert 4 not in tier.steps_at, tier.steps_at
    assert "not bit-identical" in tier.note, tier.note
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def _perturbed_compiles(monkeypatch, by):
    """K-step programs whose every call adds ``by`` to each float state leaf, with a program
    cache and verdicts of their own (the real K-step program of the step, compiled by an
    earlier test of the process, is neither used here nor replaced for the tests after it)."""
    from xshare.runtime.compiled.compiler import ProgramCache

    real = multistep._compile

    def off_by_a_little(program, form, device):
        out = real(program, form, device)
        exe = out.executable

        def perturbed(state, batches, *ident):
            new, rows = exe(state, batches, *ident)
            return [x + by if np.issubdtype(x.dtype, np.floating) else x for x in new], rows

        return multistep.MultiStep(form=out.form, executable=perturbed, footprint=out.footprint,
                                   compile_s=out.compile_s)

    monkeypatch.setattr(multistep, "_compile", off_by_a_little)
    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    monkeypatch.setattr(multistep, "PROGRAMS", ProgramCache())


def test_a_tolerance_the_user_opts_into_keeps_a_form_that_is_close(monkeypatch):
    """``steps_per_call_rtol``: the same off-by-1e-6 program, within a tolerance of 1e-3, is
    kept; explain says it is not bit-identical and how far apart it was; the job ends close to
    the plain loop (not equal: the user asked for close)."""
    _perturbed_compiles(monkeypatch, 1e-6)

    def make():
        return linreg_step.bind(linreg_state(dim=6, seed=9), linreg_data(dim=6, seed=9), steps=80, name="p")

    for _ in range(2):  # the first compiles in the background, the second checks
        with xshare.Runtime(memory="256MiB", steps_per_call=4, steps_per_call_rtol=1e-3,
                            compilation_cache=False) as rt:
            handle = rt.submit(make())
            rt.wait()
            rt._tier_pool.shutdown(wait=True)
    tier = handle._rec.tier
    assert tier.steps_at.get(4, 0) > 0, (tier.steps_at, tier.note)
    assert "within rtol 0.001" in tier.note and "not bit-identical" in tier.note, tier.note
    got, ref = handle.result()[0], plain_loop(make())[0]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-3)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))


def test_deviation_is_relative_to_each_leaf_and_exact_for_what_is_not_a_float():
    f32 = np.float32
    a = [np.array([100.0, 0.0], f32), np.array([0.0, 0.0], f32), np.array([3, 4], np.int32)]
    assert multistep.deviation(a, a) == 0.0
    near = [np.array([100.0, 0.01], f32), a[1], a[2]]
    assert multistep.deviation(a, near) == pytest.approx(1e-4, rel=1e-3)  # 0.01 of the leaf's 100
    assert multistep.deviation(a, [a[0], np.array([0.0, 1e-30], f32), a[2]]) > 1e20  # a leaf of zeros
    assert multistep.deviation(a, [a[0], a[1], np.array([3, 5], np.int32)]) == float("inf")
    assert multistep.deviation(a, [a[0], a[1], np.array([3, 4], np.int64)]) == float("inf")
    nan = [np.array([np.nan, 1.0], f32)]
    assert multistep.deviation(nan, nan) == 0.0
    assert multistep.deviation(nan, [np.array([1.0, 1.0], f32)]) == float("inf")
    v = multistep.Verdict(Form(16, False), False, 2e-4, 1e-4, why="x", deviation=1e-5)
    assert not v.usable(None) and v.usable(1e-4) and not v.usable(1e-6)
    assert "within rtol 0.0001" in v.describe(1e-4) and "not kept: x" in v.describe(None)
    slower = multistep.Verdict(Form(16, False), True, 1e-4, 2e-4)
    assert not slower.usable(None) and slower.usable(None, forced=True)


def test_an_inexact_verdict_from_before_deviations_were_kept_is_checked_again_under_a_tolerance(monkeypatch):
    """A verdict row without a deviation (written before they were kept) cannot say whether it is
    within a tolerance: under one, the form compiles and is checked again; without, it is skipped."""
    import math
    from concurrent.futures import Future

    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    form = FORMS[0]  # (K=16 rolled: a step of 1 ms is too long for K=32, ``rolled_k``)
    multistep.VERDICTS.put("k", multistep.Verdict(form, False, 2e-4, 1e-4, why="differs", deviation=math.nan))
    c = Candidate(key="k", compile=lambda f: None, steps_done=100, step_s=1e-3, steps_left=10_000,
                  gap_s=None, period=None)
    for rtol, rechecked in ((1e-3, True), (None, False)):
        tiers = Tiers(device=None, submit=lambda fn: Future(), max_k=32, compile_estimate=lambda: None,
                      forced=True, rtol=rtol)
        tier = JobTier()
        tiers.consider(tier, c)
        assert (tier.form == form) is rechecked, (rtol, tier.form, tier.note)


@pytest.mark.parametrize("bad", [-1e-3, 1.0, "loose", True])
def test_steps_per_call_rtol_refuses_a_bad_value(bad):
    with pytest.raises(ValueError, match=r"steps_per_call_rtol=.* must be a float in \[0, 1\)"):
        xshare.Runtime(memory="64MiB", steps_per_call_rtol=bad)


def test_k_never_passes_a_checkpoint(tmp_path):
    """Checkpoints every 6 steps: the K-step form is the rolled K=8 (the power of two that
    covers 6), and its calls run 6 steps each, stopping at each checkpoint (a checkpoint inside
    a call could not be written: the call donates the state it starts from)."""
    def make():
        return linreg_step.bind(linreg_state(seed=2), linreg_data(seed=2), steps=48, name="c")

    handle = run_until_k_steps(6, make, memory="256MiB", steps_per_call=16, checkpoint_dir=tmp_path,
                        checkpoint_every=6)
    tier = handle._rec.tier
    assert tier.multi.form == Form(8, False), tier.note
    assert set(tier.steps_at) <= {1, 6} and tier.steps_at.get(6, 0) > 0, tier.steps_at
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def test_one_step_per_call_when_asked():
    with xshare.Runtime(memory="256MiB", steps_per_call=1) as rt:
        handle = rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=40, name="one"))
        rt.wait()
    assert handle._rec.tier is None
    assert_trees_equal(handle.result()[0], plain_loop(linreg_step.bind(linreg_state(), linreg_data(), steps=40))[0])


@pytest.mark.parametrize("bad", [0, -2, 2.5, "fast", True])
def test_steps_per_call_refuses_a_bad_value(bad):
    with pytest.raises(ValueError, match=r"steps_per_call=.* must be 'auto' or an int >= 1"):
        xshare.Runtime(memory="64MiB", steps_per_call=bad)


def test_the_forms_tried_fit_the_jobs_boundaries():
    from xshare.runtime.engine.tiers import Tiers

    tiers = Tiers(device=None, submit=lambda fn: None, max_k=32, compile_estimate=lambda: None)
    assert tiers.forms(None) == list(FORMS)
    # (a rolled form runs any n <= K a call: K=8 covers a period of 6; an unrolled one runs K)
    assert tiers.forms(6) == [Form(8, False), Form(4, True)]
    assert tiers.forms(1) == []
    assert Tiers(device=None, submit=lambda fn: None, max_k=2, compile_estimate=lambda: None).forms(None) \
        == [Form(2, False), Form(2, True)]
    # A short step's rolled form runs 32 steps a call (``rolled_k``), within the same bounds
    assert tiers.forms(None, 100e-6) == [Form(32, False), Form(8, True)]
    assert tiers.forms(None, 1e-3) == list(FORMS)
    # ... and any n <= K a call: K=32 covers a period of 20 in one call, of 50 in two (32 + 18)
    assert tiers.forms(20, 100e-6) == [Form(32, False), Form(8, True)]
    assert tiers.forms(50, 100e-6) == [Form(32, False), Form(8, True)]
    assert tiers.forms(12) == [Form(16, False), Form(8, True)]  # (unrolled: exactly K, so <= 12)


def test_a_short_step_runs_32_steps_a_call_and_ends_as_the_plain_loop(monkeypatch):
    """A step far shorter than QUANTUM_S / 32 takes the K=32 rolled form (``rolled_k``): its
    calls run 32 steps, and the job ends bit-identical to the plain jit loop. (Under srtf, whose
    forms wait for the job's measured step time; no verdict of the program from other tests.)"""
    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    steps = 2000

    def make():
        return linreg_step.bind(linreg_state(seed=7), linreg_data(seed=7), steps=steps, name="lin")

    kw = dict(memory="256MiB", steps_per_call=32, policy="srtf", quantum=32)
    run_until_k_steps(32, make, **kw)  # compiled and checked (it may land late in the run)
    handle = run_until_k_steps(32, make, **kw)  # adopted at the job's first turn
    tier = handle._rec.tier
    assert tier.steps_at.get(32, 0) >= 1024 and tier.form == Form(32, False), (tier.steps_at, tier.note)
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def test_a_form_kept_on_this_machine_is_taken_before_one_the_step_time_asks_for(monkeypatch):
    """A program kept at K=16 (before short steps ran 32 a call) is adopted at K=16 at once: a
    relaunch that compiled K=32 first ran every step of a job shorter than that compile one per
    call, beside a kept K=16 form 5x faster."""
    from concurrent.futures import Future

    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    k16 = Form(16, False)
    multistep.VERDICTS.put("kept16", multistep.Verdict(k16, True, 16e-6, 3e-6))
    multistep.VERDICTS.put("slow16", multistep.Verdict(k16, True, 16e-6, 20e-6, checks=9))  # slower: not kept
    tiers = Tiers(device=None, submit=lambda fn: Future(), max_k=32, compile_estimate=lambda: 0.1)
    c = Candidate(key="kept16", compile=lambda f: None, steps_done=100, step_s=16e-6, steps_left=100_000,
                  gap_s=None, period=None)
    assert tiers._ordered(c.key, c.period, 16e-6) == [k16, Form(32, False), Form(8, True)]
    tier = JobTier()
    tiers.consider(tier, c)
    assert tier.form == k16 and tier.pending is not None  # (its program loaded on the pool, not compiled)
    slow = Candidate(key="slow16", compile=lambda f: None, steps_done=100, step_s=16e-6, steps_left=100_000,
                     gap_s=None, period=None)
    assert tiers._ordered(slow.key, slow.period, 16e-6) == [Form(32, False), Form(8, True)]


def test_a_kept_form_starts_loading_as_soon_as_its_program_is_keyed(monkeypatch):
    """``Tiers.prefetch`` (called by the compile pool once a job's program is keyed, before that
    program loads): the form this machine kept for the program is submitted to load at once;
    nothing for a program with no kept form, nor for one already loading."""
    from concurrent.futures import Future

    from xshare.runtime.engine.tiers import Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    k32 = Form(32, False)
    multistep.VERDICTS.put("kept", multistep.Verdict(k32, True, 60e-6, 20e-6))
    multistep.VERDICTS.put("slower", multistep.Verdict(k32, True, 60e-6, 90e-6, checks=9))
    submitted: list = []

    def submit(fn):
        submitted.append(fn)
        return Future()

    tiers = Tiers(device=None, submit=submit, max_k=32, compile_estimate=lambda: 0.1)
    loads: list = []
    tiers.prefetch("kept", loads.append, lambda form: False)
    assert len(submitted) == 1
    submitted[0]()
    assert loads == [k32]
    for key, begun in (("kept", True), ("slower", False), ("unknown", False)):
        tiers.prefetch(key, loads.append, lambda form, b=begun: b)
    assert len(submitted) == 1
    off = Tiers(device=None, submit=submit, max_k=1, compile_estimate=lambda: 0.1)  # steps_per_call=1
    off.prefetch("kept", loads.append, lambda form: False)
    # Under srtf and priority a call may take the policy's quantum / 2 at most (4 and 8 ms): a kept form is loaded ahead
    # only if K of its checked steps fit (``multicall.form_fits``); 32 x 20 us do, 16 x 600 not.
    preemptive = Tiers(device=None, submit=submit, max_k=32, compile_estimate=lambda: 0.1,
                       call_fits=lambda v: v.form.k * v.multi_step_s <= 1e-3)
    preemptive.prefetch("kept", loads.append, lambda form: False)
    assert len(submitted) == 2
    k16 = Form(16, False)
    multistep.VERDICTS.put("long", multistep.Verdict(k16, True, 900e-6, 600e-6))
    preemptive.prefetch("long", loads.append, lambda form: False)
    assert len(submitted) == 2
    for policy, bounded in (("srtf", True), ("priority", True), ("fifo", False), ("pack", False)):
        with xshare.Runtime(memory="64MiB", policy=policy) as rt:
            fits = rt._dispatcher.tiers.call_fits
            assert (fits is not None) is bounded, policy
            if bounded:  # (the runtime's own rule: the policy's quantum over dispatch_ahead + 1)
                assert fits(multistep.VERDICTS.get("kept", k32))
                assert not fits(multistep.VERDICTS.get("long", k16))


def test_under_srtf_a_kept_form_that_fits_a_call_is_weighed_at_the_first_turn(monkeypatch):
    """Under srtf and priority a unit's K is bounded by its step time, and a unit not timed yet
    was weighed only after 8 timed steps: every job of the jct trace ran its first 9-135 steps one
    per call, on the critical path of each switch to a new arrival. A form this machine kept whose
    K checked steps fit a call (``form_fits``) is weighed at once, with its program's checked
    one-step time; one that does not fit waits for the unit's own steps, as before."""
    from types import SimpleNamespace

    from xshare.runtime.engine.multicall import MultiCalls
    from xshare.sched.steps import QUANTUM_S

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    k32 = Form(32, False)
    fits_s = QUANTUM_S / 2 / 32 * 0.9    # 32 of these fit a call (the quantum over dispatch_ahead=1 + 1)
    multistep.VERDICTS.put("fits", multistep.Verdict(k32, True, 2 * fits_s, fits_s))
    multistep.VERDICTS.put("long", multistep.Verdict(k32, True, 4 * fits_s, 2 * fits_s))
    weighed: list = []
    calls = SimpleNamespace(config=SimpleNamespace(preemptive=True, dispatch_ahead=1, quantum=1, call_quantum_s=QUANTUM_S),
                            device=None,
                            units=SimpleNamespace(running={}), timeline=SimpleNamespace(host_gap_s=None),
                            tiers=SimpleNamespace(keeps=lambda v: v.kept, tier=lambda job: "its tier",
                                                  consider=lambda tier, c: weighed.append((c.key, c.step_s))),
                            period=lambda job, step_s=None: None, _paces={})
    calls.fastest_pace = lambda key: MultiCalls.fastest_pace(calls, key)
    for key in ("fits", "long"):
        job = SimpleNamespace(is_group=False, group=None, program=SimpleNamespace(key=key), steps_left=500,
                              steps_done=0, step_times=[], host_gap_s=None)
        calls.units.running = {1: job}
        MultiCalls.consider(calls, job)
    assert weighed == [("fits", 2 * fits_s)]


def test_each_preemptive_policy_caps_a_call_by_its_own_quantum():
    """``Policy.quantum_s``: srtf's calls may hold the device twice as long as priority's (16 ms
    in flight against 8). On a slow evening the jct trace's 128-wide MLP was checked at 331 us a
    step at K=8 and ~280 at K=16: within 8 ms in flight (4 a call) only K=8 fit, calls shorter
    than the host's work between them, and srtf's makespan was 1.2x fifo's."""
    from xshare.runtime.config import RuntimeConfig
    from xshare.runtime.engine.multicall import call_cap, form_fits
    from xshare.sched import get_policy
    from xshare.sched.steps import QUANTUM_S, SRTF_QUANTUM_S

    srtf, priority, fifo = (RuntimeConfig.of(get_policy(p)) for p in ("srtf", "priority", "fifo"))
    assert (srtf.call_quantum_s, priority.call_quantum_s, fifo.call_quantum_s) == (SRTF_QUANTUM_S, QUANTUM_S, QUANTUM_S)
    assert srtf.dispatch_ahead == priority.dispatch_ahead == 1
    assert call_cap(srtf, 280e-6) == 16 and call_cap(priority, 280e-6) == 8
    k16 = multistep.Verdict(Form(16, False), True, 409e-6, 280e-6)
    assert form_fits(srtf, k16) and not form_fits(priority, k16)


def test_a_unit_not_timed_yet_takes_its_forms_from_its_programs_checked_step_time(monkeypatch):
    """At a relaunch a unit's first turn comes before its steps are timed: the one-step time its
    program's check measured (kept beside the cache) chooses its rolled K, so the K=32 form a
    short step kept is adopted at once, not after its first steps."""
    from concurrent.futures import Future

    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    k32 = Form(32, False)
    multistep.VERDICTS.put("short", multistep.Verdict(k32, True, 140e-6, 77e-6))
    submitted: list = []
    tiers = Tiers(device=None, submit=lambda fn: submitted.append(fn) or Future(), max_k=32,
                  compile_estimate=lambda: None)
    for key, form in (("short", k32), ("unknown", None)):
        c = Candidate(key=key, compile=lambda f: None, steps_done=0, step_s=None, steps_left=3000,
                      gap_s=None, period=None)
        tier = JobTier()
        tiers.consider(tier, c)
        assert tier.form == form, (key, tier.form, tier.note)
    assert len(submitted) == 1  # the kept K=32 form is loaded; the unknown program waits for its steps


def test_first_difference_names_the_leaf():
    a = [np.zeros(3, np.float32), np.ones(2, np.float32)]
    b = [np.zeros(3, np.float32), np.array([1, 1.5], np.float32)]
    assert multistep.first_difference(a, a, "state") is None
    assert multistep.first_difference(a, b, "state") == "state leaf 1 differs (max |difference| 0.5)"


def _fused_until(make, ran, runs=3):
    """Run ``make()``'s jobs fused at ``steps_per_call=8`` in fresh Runtimes until every member's
    steps per call (``JobTier.steps_at``) satisfy ``ran`` (the first run compiles the group's
    K-step form in the background; a later one adopts it). At most ``runs``; the last handles."""
    for _ in range(runs):
        with xshare.Runtime(memory="256MiB", fuse="always", steps_per_call=8) as rt:
            handles = rt.submit_many(make())
            rt.wait()
            rt._tier_pool.shutdown(wait=True)
        if all(h._rec.tier is not None and ran(h._rec.tier.steps_at) for h in handles):
            break
    return handles


def test_a_fused_group_runs_k_steps_per_call_and_matches_the_vmapped_loop():
    """A fused group moves to its K-step program too: every member ends bit-identical to the
    same vmapped step in a plain loop (the fused contract), with most member steps at K."""
    from tests.users.harness import vmapped_loop

    def make():
        return [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=96, name=f"f{i}")
                for i in range(3)]

    handles = _fused_until(make, lambda at: at.get(8, 0) >= 48)
    assert all(h._rec.tier.steps_at.get(8, 0) >= 48 for h in handles), [h._rec.tier for h in handles]
    want = vmapped_loop(make(), 4, 96)
    for h, w in zip(handles, want):
        assert_trees_equal(h.result()[0], w)
        assert h.progress().steps_done == 96  # (each member's rows counted at once: no reader of each)


def test_a_rolled_call_runs_the_steps_left_in_one_call_and_ends_as_the_plain_loop():
    """69 steps at K=16 rolled: four calls of 16, then the last 5 in one call of the same
    program (its loop's trip count is an operand), not five one-step calls. Every step's
    metrics row and the final state as the plain loop's."""
    def make(observer=None):
        return linreg_step.bind(linreg_state(dim=6, seed=11), linreg_data(dim=6, seed=11), steps=69,
                                name="tail", observer=observer)

    run_until_k_steps(16, make, memory="256MiB", steps_per_call=16)  # (checked and built here)
    seen = []
    with xshare.Runtime(memory="256MiB", steps_per_call=16) as rt:
        handle = rt.submit(make(lambda step, metrics, t: seen.append((step, np.asarray(metrics["loss"])))))
        rt.wait()
    assert handle._rec.tier.multi.form == Form(16, False)
    assert handle._rec.tier.steps_at == {16: 64, 5: 5}, handle._rec.tier.steps_at
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])
    want = _plain_losses(make(), 69)
    assert [step for step, _ in seen] == list(range(69))
    for (_, got), w in zip(seen, want):
        assert np.asarray(got, np.float32).tobytes() == w.tobytes()  # (rows reach observers as floats)


def _plain_losses(spec, steps):
    """Each step's loss of ``spec`` in a plain jitted loop (the reference for rows)."""
    import jax

    f = jax.jit(spec.fn)
    state, out = spec.state, []
    for k in range(steps):
        state, metrics = f(state, spec.data(k))
        out.append(np.asarray(metrics["loss"]))
    return out


def test_a_fused_groups_rolled_call_runs_its_members_last_steps_in_one_call():
    """A fused group of 3 at K=8 rolled over 44 steps: five calls of 8, then the last 4 in one
    call; every member bit-identical to the vmapped loop."""
    from tests.users.harness import vmapped_loop

    def make():
        return [linreg_step.bind(linreg_state(seed=20 + i), linreg_data(seed=20 + i), steps=44, name=f"g{i}")
                for i in range(3)]

    handles = _fused_until(make, lambda at: at.get(4))
    for h in handles:
        assert h._rec.tier.steps_at.get(4) == 4 and h._rec.tier.steps_at.get(8, 0) >= 8, h._rec.tier.steps_at
    for h, w in zip(handles, vmapped_loop(make(), 4, 44)):
        assert_trees_equal(h.result()[0], w)


def test_under_srtf_the_k_step_form_fits_the_time_a_call_may_take(monkeypatch):
    """Under srtf a call runs only as many steps as fit its quantum (``preemptive_cap``, here
    pinned to 4: it depends on the measured step time); the tiers compile a form of that K,
    not K=16, which would never fit and would leave the job at one step per call."""
    from xshare.runtime.engine.multicall import MultiCalls

    monkeypatch.setattr(MultiCalls, "preemptive_cap", lambda self, job, step_s=None: 4)

    def make():
        return linreg_step.bind(linreg_state(seed=7), linreg_data(seed=7), steps=256, name="q")

    # (steps_per_call=16: the tiers compile at once, without weighing the compile; before
    # this bound they compiled K=16, which no call here could run)
    handle = run_until_k_steps(4, make, memory="256MiB", policy="srtf", steps_per_call=16)
    steps_at = handle._rec.tier.steps_at
    assert steps_at.get(4) and set(steps_at) <= {1, 4}, (steps_at, handle._rec.tier)
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def test_the_checks_timing_is_the_fastest_of_its_rounds_not_one_disturbed_call(monkeypatch):
    # A burst on another thread (a compile beside a first run) slowed one timed call 10x and the
    # "slower" verdict stood for every later run of the program: each side counts its fastest round.
    import time
    from types import SimpleNamespace

    import jax.numpy as jnp

    from xshare.runtime.engine import multicall

    monkeypatch.setattr(multicall, "TIMING_BUDGET_S", 10.0)  # every round runs
    calls = {"multi": 0, "singles": 0}

    def multi_exe(state, batch):
        calls["multi"] += 1
        if calls["multi"] == 1:
            time.sleep(0.02)  # the disturbed first round
        return [x + 1 for x in state], jnp.zeros((4, 1))

    def singles(state):
        calls["singles"] += 1
        time.sleep(0.004)  # 1 ms per step, every round
        return [x + 1 for x in state]

    multi = SimpleNamespace(k=4, executable=multi_exe, arg=lambda batch, n: batch)
    jax.block_until_ready(jnp.zeros(3) + 1)  # (the fake steps' add, compiled before the clock)
    multi_s, single_s = multicall._timed(multi, [jnp.zeros(3)], None, None, singles)
    assert calls == {"multi": multicall.TIMING_ROUNDS, "singles": multicall.TIMING_ROUNDS}
    assert multi_s < 0.002 < 0.02 / 4  # not the disturbed round
    assert 0.001 <= single_s < 0.003
    assert multi_s < single_s  # the verdict the undisturbed rounds give: faster at K


def test_a_round_longer_than_the_checks_timing_budget_is_its_only_one(monkeypatch):
    from types import SimpleNamespace

    import jax.numpy as jnp

    from xshare.runtime.engine import multicall

    monkeypatch.setattr(multicall, "TIMING_BUDGET_S", 0.0)  # the first round spends it
    calls = []
    multi = SimpleNamespace(k=2, executable=lambda state, batch: (calls.append(1) or state, jnp.zeros((2, 1))),
                            arg=lambda batch, n: batch)
    multicall._timed(multi, [jnp.zeros(3)], None, None, None)
    assert len(calls) == 1


def test_a_program_that_ran_here_before_weighs_its_k_step_compile_against_its_later_runs_too(monkeypatch, tmp_path):
    """A form one run cannot repay is compiled once a program has run on this machine before:
    the form is kept for its later runs (compiled/history.py). Recorded once per process."""
    from concurrent.futures import Future

    from xshare.runtime.compiled import history
    from xshare.runtime.engine import tiers as tiers_module
    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    monkeypatch.setattr(multistep.VERDICTS, "typical_call_s", lambda: 60e-6)
    # K=32 (a 100 us step: ``rolled_k``) saves ~58 us a step: 2992 steps left ~0.17 s, less than
    # a ~0.45 s compile (0.3 s x 1.5 rolled)
    c = Candidate(key="k", compile=lambda f: None, steps_done=8, step_s=100e-6, steps_left=2992,
                  gap_s=None, period=None)

    def weigh(past: history.Runs | None) -> JobTier:
        table = history.RunHistory()
        table.persist(str(tmp_path / ("h" if past is None else f"h{past.runs}")))
        if past is not None:
            table._table.put("k", past)
        monkeypatch.setattr(tiers_module, "HISTORY", table)
        tier = JobTier()
        Tiers(device=None, submit=lambda fn: Future(), max_k=32, compile_estimate=lambda: 0.3).consider(tier, c)
        return tier

    first = weigh(None)
    assert first.form is None and "less than its compile" in first.note
    assert history.Runs(1, 3000).expected_steps() == 3000
    again = weigh(history.Runs(1, 3000))   # 5992 steps: ~0.34 s, still less
    assert again.form is None and "~3000 its earlier runs here ran without it" in again.note
    # Every earlier run's steps count (ski rental's rent paid), not three runs' at most: eight
    # short runs of 1,000 steps make 10,992 with this one's, ~0.64 s. Counted as three more runs
    # of the average (3,000), a program rerun at that length never got its form.
    assert history.Runs(8, 8000).expected_steps() == 8000
    short_often = weigh(history.Runs(8, 8000))
    assert short_often.form == Form(32, False) and "~8000 its earlier runs here ran without it" in short_often.note
    often = weigh(history.Runs(5, 15000))  # 17992 steps, ~1.0 s
    assert often.form == Form(32, False) and "compiling" in often.note
    table = tiers_module.HISTORY
    assert table.get("k") == history.Runs(6, 18000)  # this run counted, once
    tier = next(iter(table._seen["k"].units))
    assert table.begin("k", tier, 3000) == 15000 and table.get("k") == history.Runs(6, 18000)
    other = JobTier()  # another job of the program in this process: its steps count, the run does not again
    assert table.begin("k", other, 500) == 15000 and table.get("k") == history.Runs(6, 18500)
    reread = history.RunHistory()
    reread.persist(str(tmp_path / "h5"))
    assert reread.get("k") == history.Runs(6, 18500)  # kept beside the compilation cache


def test_the_steps_a_job_runs_while_its_k_step_form_compiles_do_not_repay_the_compile(monkeypatch, tmp_path):
    """A form compiled in the background lands after its compile: weighed against every step
    left, 8 x 2,000 steps under pack from an empty cache compiled a K=16 form that landed with a
    sixth of them to go (0.80x the plain loop; 0.88x without it)."""
    from concurrent.futures import Future

    from xshare.runtime.compiled import history
    from xshare.runtime.engine import tiers as tiers_module
    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    monkeypatch.setattr(multistep.VERDICTS, "typical_call_s", lambda: 60e-6)
    table = history.RunHistory()
    table.persist(str(tmp_path))
    monkeypatch.setattr(tiers_module, "HISTORY", table)

    def weigh(left: int) -> JobTier:
        # ~58 us a step saved at K=32 of 100 us; a ~0.45 s compile, ~4500 steps run meanwhile
        c = Candidate(key=f"k{left}", compile=lambda f: None, steps_done=8, step_s=100e-6, steps_left=left,
                      gap_s=None, period=None)
        tier = JobTier()
        Tiers(device=None, submit=lambda fn: Future(), max_k=32, compile_estimate=lambda: 0.3).consider(tier, c)
        return tier

    short = weigh(12_000)   # 7500 steps after it lands: ~0.44 s (all 12,000 would be ~0.70 s)
    assert short.form is None and "~4500 of those steps run while it compiles" in short.note
    long = weigh(20_000)    # 15,500 after it: ~0.87 s
    assert long.form == Form(32, False) and "compiling" in long.note


def test_a_fused_group_whose_measured_host_gap_exceeds_the_kept_forms_call_cost_expects_to_save_its_gap(
        monkeypatch, tmp_path):
    """The hook's fused group of 8: a ~100 us host gap a call where the solo forms kept here
    saved ~45 us a step. Weighed by the solo figure its K=16 form never repaid its compile, by
    any run; weighed by its own gap it compiles (and its check then times it, as any form's)."""
    from concurrent.futures import Future

    from xshare.runtime.compiled import history
    from xshare.runtime.engine import tiers as tiers_module
    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    monkeypatch.setattr(multistep.VERDICTS, "typical_call_s", lambda: 45e-6)
    table = history.RunHistory()
    table.persist(str(tmp_path))
    monkeypatch.setattr(tiers_module, "HISTORY", table)

    def weigh(gap_s: float | None, group: bool = True) -> JobTier:
        # 200 us a group step on the device; 6000 steps left; a 0.75 s compile (0.5 s x 1.5 rolled)
        c = Candidate(key=f"g{gap_s}{group}", compile=lambda f: None, steps_done=32, step_s=200e-6,
                      steps_left=6000, gap_s=gap_s, period=None, group=group)
        tier = JobTier()
        Tiers(device=None, submit=lambda fn: Future(), max_k=32, compile_estimate=lambda: 0.5).consider(tier, c)
        return tier

    # (K=32: 32 steps of 200 us fit in QUANTUM_S, ``rolled_k``; the steps run while it compiles
    # save nothing: 0.75 s at 220 us a step, ~3400 of them)
    small = weigh(20e-6)   # a gap under the kept forms' 45 us: ~44 us a step x ~2600, ~0.11 s
    assert small.form is None and "would save ~44 us/step" in small.note
    # its own 400 us gap: 600 us a step, ~1250 of them meanwhile; ~388 us a step x ~4750, ~1.8 s
    group = weigh(400e-6)
    assert group.form == Form(32, False) and "compiling" in group.note and "~388 us/step" in group.note
    # A solo job's gap over the kept figure is a compile beside it holding the GIL: not counted
    solo = weigh(400e-6, group=False)
    assert solo.form is None and "would save ~44 us/step" in solo.note


def test_a_form_another_job_of_the_program_began_compiling_is_taken_whatever_is_left_to_repay(monkeypatch, tmp_path):
    """A sweep under fifo on an empty cache: the first job starts its program's K=16 compile and
    ends before it is built (no check, no verdict). A later job with 468 steps left would not
    repay a new compile, but this one is paid already: it takes it (the check still decides).
    Weighed as new, every later job ran one step per call (scale.py, N=32 x 500: 0.72x the loop)."""
    from concurrent.futures import Future

    from xshare.runtime.compiled import history
    from xshare.runtime.engine import tiers as tiers_module
    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    monkeypatch.setattr(multistep, "VERDICTS", multistep.Verdicts())
    monkeypatch.setattr(multistep.VERDICTS, "typical_call_s", lambda: 70e-6)
    table = history.RunHistory()
    table.persist(str(tmp_path))
    monkeypatch.setattr(tiers_module, "HISTORY", table)
    submitted = []

    def weigh(begun: bool, steps_done: int = 32) -> JobTier:
        c = Candidate(key="p", compile=lambda f: None, steps_done=steps_done, step_s=100e-6, steps_left=468,
                      gap_s=20e-6, period=None, begun=lambda form: begun)
        tier = JobTier()
        Tiers(device=None, submit=lambda fn: submitted.append(fn) or Future(), max_k=32,
              compile_estimate=lambda: 0.97).consider(tier, c)
        return tier

    new = weigh(begun=False)   # ~70 us a step x 468 steps against a ~1.45 s compile
    assert new.form is None and new.pending is None and "less than its compile" in new.note
    assert not submitted
    taken = weigh(begun=True, steps_done=0)  # (at its first turn: no step time needed)
    assert taken.form == Form(32, False) and taken.pending is not None and len(submitted) == 1
    assert "compiled for another job of its program" in taken.note


def test_under_srtf_a_kept_form_is_capped_by_its_own_step_time_not_by_one_step_per_calls(monkeypatch):
    """The trace's 64-wide MLP: 107 us a step one per call, 49 at K=16. Under srtf a call may take
    QUANTUM_S over dispatch_ahead=1 + 1 (1 ms when this was found, at QUANTUM_S = 2 ms): K=16
    fits at 49 us a step. Capped by its one-step time (K=8) the job adopted K=16 from the
    machine's verdicts and then ran every step one per call (the cap was below its only form).
    (Times here are scaled by QUANTUM_S / 2 ms, so the trace's numbers keep their meaning.)"""
    from types import SimpleNamespace

    from xshare.runtime.engine.multicall import MultiCalls
    from xshare.sched.steps import QUANTUM_S

    us = 1e-6 * QUANTUM_S / 2e-3

    k16 = next(f for f in FORMS if f.k == 16 and not f.unroll)
    verdicts = multistep.Verdicts()
    verdicts.put("p", multistep.Verdict(k16, True, 107 * us, 49 * us))
    monkeypatch.setattr(multistep, "VERDICTS", verdicts)
    calls = SimpleNamespace(config=SimpleNamespace(dispatch_ahead=1, quantum=1, preemptive=True,
                                                   checkpoint_dir=None, call_quantum_s=QUANTUM_S),
                            tiers=SimpleNamespace(keeps=lambda v: v.kept))
    calls.preemptive_cap = lambda job, step_s=None: MultiCalls.preemptive_cap(calls, job, step_s)
    job = SimpleNamespace(step_time_s=107 * us, tier=SimpleNamespace(multi=None, step_s=None),
                          eval=None, spec=SimpleNamespace(on_metrics=None, on_metrics_every=None),
                          program=SimpleNamespace(key="p"))
    assert calls.preemptive_cap(job) == 8                       # one step per call: 8 fit
    assert MultiCalls.period(calls, job, 107 * us) == 16         # its K=16 form fits at its own speed
    job.tier = SimpleNamespace(multi=object(), step_s=49 * us)   # it adopted that form
    assert calls.preemptive_cap(job) == 16
    job.tier.step_s, job.step_time_s = 126 * us, 120 * us        # the check timed it a little slower
    assert calls.preemptive_cap(job) == 8                        # the lesser: as it was adopted
    verdicts.put("p", multistep.Verdict(k16, True, 300 * us, 200 * us))
    job.tier = SimpleNamespace(multi=None, step_s=None)
    assert MultiCalls.period(calls, job, 300 * us) == 2          # 16 x 200 us does not fit: not allowed


def test_a_jobs_form_pace_is_its_fastest_kept_forms_check_with_its_batches(monkeypatch):
    """``MultiCalls.form_step_s``: what srtf ranks a job's steps by in its multi-step form. The
    fastest kept form's check (its K-step call over K) plus the time to make a batch where the
    dispatcher makes them, the slower of the two where a feeder does; a form not kept, or whose
    K steps at its pace do not fit a call under a preemptive policy, does not count; a group,
    or a job whose boundaries come every step, has none. A new verdict is seen at the next ask (the paces are kept per program until the
    verdicts change)."""
    from types import SimpleNamespace

    from xshare.runtime.engine.multicall import MultiCalls

    k8, k32 = multistep.Form(8, False), multistep.Form(32, False)
    verdicts = multistep.Verdicts()
    verdicts.put("p", multistep.Verdict(k8, True, 176e-6, 95e-6))
    verdicts.put("p", multistep.Verdict(k32, True, 176e-6, 87e-6))
    verdicts.put("q", multistep.Verdict(k32, False, 176e-6, 50e-6, deviation=1e-3))  # not exact
    monkeypatch.setattr(multistep, "VERDICTS", verdicts)
    fed = [False]
    calls = SimpleNamespace(config=SimpleNamespace(preemptive=False, dispatch_ahead=1, quantum=1, call_quantum_s=8e-3),
                            tiers=SimpleNamespace(keeps=lambda v: v.kept), _fed=lambda unit: fed[0], _paces={},
                            period=lambda unit: getattr(unit, "period", None))
    calls.fastest_pace = lambda key: MultiCalls.fastest_pace(calls, key)
    pace = lambda unit, data_s=None: MultiCalls.form_step_s(calls, unit, data_s)  # noqa: E731
    job = SimpleNamespace(is_group=False, program=SimpleNamespace(key="p"))
    assert pace(job) == pytest.approx(87e-6)
    assert pace(job, 100e-6) == pytest.approx(187e-6)            # made inline before each step
    fed[0] = True
    assert pace(job, 100e-6) == pytest.approx(100e-6)            # made beside them: the slower
    calls.config.preemptive, calls.config.call_quantum_s = True, 4e-3
    calls._paces.clear()
    assert pace(job) == pytest.approx(95e-6)                     # 32 x 87 us > 2 ms a call; 8 x 95 fit
    verdicts.put("p", multistep.Verdict(Form(16, False), True, 176e-6, 90e-6))
    assert pace(job) == pytest.approx(90e-6)                     # a new verdict: seen at once
    assert pace(SimpleNamespace(is_group=False, program=SimpleNamespace(key="p"), period=1)) is None  # a report every step
    assert pace(SimpleNamespace(is_group=False, program=SimpleNamespace(key="q"))) is None
    assert pace(SimpleNamespace(is_group=False, program=None)) is None
    assert pace(SimpleNamespace(is_group=True, program=SimpleNamespace(key="p"))) is None


def test_a_form_timed_slower_is_checked_again_by_later_runs_then_left_off(monkeypatch, tmp_path):
    """One disturbed timing must not hold a program at one step per call on a machine for good:
    a bit-identical form timed slower is checked again by the next runs (a load of its kept
    program and one check), up to RECHECKS checks in all; a form never exact is not."""
    from concurrent.futures import Future

    from xshare.runtime.engine.tiers import Candidate, JobTier, Tiers

    verdicts = multistep.Verdicts()
    monkeypatch.setattr(multistep, "VERDICTS", verdicts)
    k16 = next(f for f in FORMS if f.k == 16 and not f.unroll)
    slower = multistep.Verdict(k16, True, 120e-6, 331e-6)
    verdicts.put("p", slower)
    started = []
    c = Candidate(key="p", compile=lambda f: None, steps_done=50, step_s=100e-6, steps_left=100,
                  gap_s=None, period=None)

    def run():  # a new runtime (a later process): its first job of the program weighs the forms
        tiers = Tiers(device=None, submit=lambda fn: started.append(fn) or Future(), max_k=16,
                      compile_estimate=lambda: 0.3)
        tier = JobTier()
        tiers.consider(tier, c)
        again = JobTier()
        tiers.consider(again, c)   # another job of it in the same runtime: not checked twice
        return tiers, tier, again

    tiers, tier, again = run()
    assert tier.form == k16 and "checking K=16 rolled again" in tier.note and len(started) == 1
    assert again.form is None and len(started) == 1
    multi = SimpleNamespace(form=k16)
    assert not tiers.settle(tier, "p", multi, slower, fits=True)      # slower again: 2 checks
    assert verdicts.get("p", k16).checks == 2
    tiers, tier, _ = run()
    assert tier.form == k16 and len(started) == 2                    # the next run checks it again
    faster = multistep.Verdict(k16, True, 107e-6, 49e-6)
    assert tiers.settle(tier, "p", multi, faster, fits=True)          # this time it was not disturbed
    assert verdicts.get("p", k16) == dataclasses.replace(faster, checks=3) and not faster.recheck
    verdicts.put("p", dataclasses.replace(slower, checks=multistep.RECHECKS))
    _, tier, _ = run()
    assert tier.form is None and k16 in tier.tried and len(started) == 2  # left off: the next form weighed
    verdicts.put("p", multistep.Verdict(k16, False, 120e-6, 60e-6, why="state leaf 0 differs"))
    _, tier, _ = run()
    assert tier.form is None and k16 in tier.tried and len(started) == 2  # never exact: never again


@xshare.job
def shift_step(state, batch):
    """The new state has the batch's shape and dtype, so XLA may write it into the (donated)
    batch's buffer: a batch the runtime did not copy would be the user's array overwritten."""
    w = state["w"] * 0.5 + batch["x"]
    return {"w": w}, {"w0": w[0]}


def test_a_job_on_its_k_step_form_never_donates_the_users_arrays_in_its_single_steps():
    """Batches made while a job is on its K-step form are not copied (stacking copies them);
    the single steps at its end (35 = 8 calls of 4 + 3) take their own copies first (a step
    donates its batch: it must never be an array the user still holds)."""
    x = jax.numpy.arange(4, dtype=np.float32)
    batch = {"x": x}  # the same device arrays every step, as a dataset kept on the device gives them

    def make():
        return shift_step.bind({"w": np.zeros(4, np.float32)}, lambda step: batch, steps=35, name="shift")

    handle = run_until_k_steps(4, make, memory="256MiB", steps_per_call=4)
    assert handle._rec.tier.steps_at.get(4, 0) >= 8 and handle._rec.tier.steps_at.get(1, 0) >= 3, \
        handle._rec.tier.steps_at
    assert not x.is_deleted()
    np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32))
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def test_a_job_whose_program_has_a_checked_and_built_form_runs_it_from_its_first_step():
    """A later job of a program whose K-step form this process checked and built runs every
    step on it: the form is adopted at the job's first turn, taken at once rather than through
    the compile pool (a round trip in which its first run of one-step calls would go)."""
    def make():
        return linreg_step.bind(linreg_state(dim=5, seed=7), linreg_data(dim=5, seed=7), steps=64, name="again")

    first = run_until_k_steps(8, make, memory="256MiB", steps_per_call=8)
    assert first._rec.tier.steps_at.get(8), first._rec.tier.steps_at
    with xshare.Runtime(memory="256MiB", steps_per_call=8) as rt:
        handle = rt.submit(make())
        rt.wait()
    assert handle._rec.tier.steps_at == {8: 64}, handle._rec.tier.steps_at
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


@xshare.job
def halve_step(state, batch):
    """A step no other test runs: its K-step form has no verdict in this process, so its first
    K-step call is preceded by the check."""
    w = state["w"] * 0.5 + batch["x"] * 0.25
    return {"w": w}, {"w0": w[0]}


def test_a_job_whose_last_steps_are_its_k_step_forms_check_ends_done(monkeypatch):
    # The check runs the job's next K steps one per call and retires them itself (not through
    # the pipeline). When those are its last steps, nothing else settled the job: it stayed
    # "running" with every step done, and Runtime.wait() never returned (found by random runs of
    # users' code under controls: tests/users/test_random_controls.py). Made to happen here: one
    # step per turn after the 8-step warm-up (whose retirement starts the K=2 form's compile),
    # each retired at once (dispatch_ahead=0), and the observer holding step 8 until the form is
    # compiled, so the check takes steps 9 and 10, the last two.
    import time

    from xshare.runtime.engine import executor
    monkeypatch.setattr(executor, "run_steps", lambda step_s: 1)
    handle = None

    def observer(step, metrics, t_done):
        if step == 8:
            deadline = time.monotonic() + 30
            while not (handle._rec.tier and handle._rec.tier.pending and handle._rec.tier.pending.done()):
                assert time.monotonic() < deadline, "the K=2 form did not compile within 30 s"
                time.sleep(0.005)

    def make(**kw):
        return halve_step.bind({"w": np.zeros(4, np.float32)}, lambda step: {"x": np.full(4, step, np.float32)},
                               steps=11, name="last", **kw)

    with xshare.Runtime(memory="256MiB", steps_per_call=2, dispatch_ahead=0, compilation_cache=False) as rt:
        handle = rt.submit(make(observer=observer))
        assert rt.wait(timeout=20), [(j["name"], j["status"], j["steps_done"]) for j in rt.snapshot()["jobs"]]
    tier = handle._rec.tier
    assert handle.status() == "done", handle.status()
    # The check ran, on the last two steps (the steps a tier counts: the check's single steps).
    assert tier.note.startswith("K=2 rolled") and tier.steps_at == {1: 2}, (tier.steps_at, tier.note)
    assert_trees_equal(handle.result()[0], plain_loop(make())[0])


def test_counting_a_jobs_ready_batches_survives_the_feeder_appending_meanwhile(monkeypatch):
    """The feeder thread appends to a job's batches while the dispatcher counts those a K-step
    call may take. Counted by a Python loop over the deque, an append between two of its steps
    raised "deque mutated during iteration" and failed the dispatcher (CI, a fused group whose
    members were cancelled). Here each batch checked makes the feeder's append land mid-count."""
    from collections import deque

    from xshare.runtime.engine.multicall import MultiCalls
    from xshare.runtime.engine.source import END

    sig = (((2,), np.dtype("float32")),)
    batch = (np.zeros(2, np.float32),)
    job = SimpleNamespace(batches=deque([batch] * 3), source=None, program=SimpleNamespace(batch_signature=sig))
    fits = multistep.fits

    def fits_while_the_feeder_appends(b, s):
        job.batches.append(batch)
        return fits(b, s)

    monkeypatch.setattr(multistep, "fits", fits_while_the_feeder_appends)
    calls = object.__new__(MultiCalls)
    calls._fed = lambda job: True
    assert calls.ready_batches(job, 8) == 3  # those there when it looked; the rest count next turn
    assert calls.ready_batches(job, 4) == 4
    job.batches = deque([batch, END, batch])
    assert calls.ready_batches(job, 8) == 1  # the end stops the call before it
