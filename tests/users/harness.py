"""What every users'-code test checks, whatever framework wrote the step: the job under xshare
ends bit-identical to the reference way of running the same code (``jax.jit``, ``nnx.jit``,
``eqx.filter_jit``) under every policy; fused, it is close to the same step vmapped in a plain
loop and to the reference (vmap may reorder reductions: DESIGN's tolerance); and checkpointed
mid-run then resumed, it ends bit-identical to an uninterrupted run.

A case gives specs, their references (final states, as pytrees) and ``canon``: the job's result
state as the pytree the reference is (``nnx.state(objects)`` for an NNX job).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare

STEPS = 12
RESUME_STEPS, FAIL_AT, CHECKPOINT_EVERY = 20, 13, 5


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def comparable(x: Any) -> Any:
    """A leaf as something ``np.testing`` compares exactly: a typed key by its key data (and
    impl), an array as numpy (dtype kept: bf16 stays bf16), anything else (a static leaf) as is."""
    if _is_key(x):
        return (str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    if _is_array(x):
        return np.asarray(x)
    return x


def assert_states_equal(got: Any, want: Any, *, what: str = "state") -> None:
    """Same structure, and every leaf equal bit for bit (dtype included)."""
    gl, gdef = jax.tree.flatten(got)
    wl, wdef = jax.tree.flatten(want)
    assert gdef == wdef, f"{what}: structures differ\n got {gdef}\nwant {wdef}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        g, w = comparable(g), comparable(w)
        if isinstance(g, tuple):
            assert g[0] == w[0], f"{what}: leaf {i}: key impl {g[0]} != {w[0]}"
            g, w = g[1], w[1]
        if isinstance(g, np.ndarray):
            assert g.dtype == np.asarray(w).dtype, f"{what}: leaf {i}: {g.dtype} != {np.asarray(w).dtype}"
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: leaf {i}")
        else:
            assert g == w, f"{what}: static leaf {i}: {g!r} != {w!r}"


def max_gap(got: Any, want: Any) -> float:
    gaps = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
            if _is_array(g) and not _is_key(g) and np.size(g)]
    return max(gaps, default=0.0)


def run(specs: Sequence[xshare.JobSpec], **runtime_kwargs: Any) -> tuple[list, dict]:
    """The specs in one Runtime; (their handles, all done, the runtime's last snapshot)."""
    runtime_kwargs.setdefault("memory", "512MiB")
    with xshare.Runtime(**runtime_kwargs) as rt:
        handles = rt.submit_many(list(specs))
        rt.wait()
        snap = rt.snapshot()
    assert [h.status() for h in handles] == ["done"] * len(handles), [h.error for h in handles]
    return handles, snap


def check_policy(policy: str, specs: Sequence[xshare.JobSpec], refs: Sequence[Any],
                 canon: Callable[[Any], Any] = lambda s: s) -> None:
    handles, _ = run(specs, policy=policy)
    for h, ref in zip(handles, refs):
        assert_states_equal(canon(h.result()[0]), ref, what=f"{h.name} under {policy}")


def check_fused(specs: Sequence[xshare.JobSpec], refs: Sequence[Any],
                canon: Callable[[Any], Any] = lambda s: s, *, tolerance: float = 1e-5) -> None:
    """Jobs of one structure fuse (every step of theirs ran in a group), and each member ends
    within ``tolerance`` of the same step vmapped in a plain loop and of its reference.

    Not bit for bit: the runtime's fused program (flat leaves, packed metrics, slot masks) is
    another XLA program than a hand-written vmap, and XLA CPU fuses and orders them differently
    (a BatchNorm MLP differs by an ulp or two after 12 Adam steps); the linear step of
    ``tests/runtime/test_fusion.py`` is small enough to come out exactly equal."""
    # fuse="always": this checks the fused path's numbers, so no group may dissolve because a
    # measurement on this machine found fusing slower for its program (fuse=True does that)
    handles, snap = run(specs, policy="pack", fuse="always")
    assert snap["runtime"]["fused_member_steps"] == sum(s.steps for s in specs), "the jobs did not fuse"
    capacity = 1 << max(1, (len(specs) - 1).bit_length())
    want = vmapped_loop(specs, capacity, specs[0].steps)
    for h, vm, ref in zip(handles, want, refs):
        got = canon(h.result()[0])
        jax.tree.map(lambda *_: None, got, vm)  # same structure, or this raises
        assert max_gap(got, vm) < tolerance, f"{h.name}: {max_gap(got, vm)} from the vmapped loop"
        assert max_gap(got, ref) < tolerance, f"{h.name}: {max_gap(got, ref)} from its reference"


def check_resume(tmp_path: Path, make_spec: Callable[[Callable[[int], Any]], xshare.JobSpec],
                 data: Callable[[int], Any], ref: Any, canon: Callable[[Any], Any] = lambda s: s) -> None:
    """A run whose data fails at batch FAIL_AT leaves a checkpoint of a step before it; a resumed
    run continues from it and ends bit-identical to ``ref`` (an uninterrupted RESUME_STEPS)."""
    def failing(step: int) -> Any:
        if step == FAIL_AT:
            raise RuntimeError("interrupted on purpose")
        return data(step)

    with xshare.Runtime(memory="512MiB", log_dir=tmp_path, checkpoint_every=CHECKPOINT_EVERY) as rt:
        first = rt.submit(make_spec(failing))
        rt.wait()
    assert first.status() == "failed" and first.progress().steps_done == FAIL_AT, first.error
    with xshare.Runtime(memory="512MiB", log_dir=tmp_path, resume=True) as rt:
        again = rt.submit(make_spec(data))
        rt.wait()
    assert again.status() == "done", again.error
    # It resumed from a checkpoint of the first run (ran only the steps after it; which one
    # depends on how far the pipeline had run) and ended where it should.
    log = (tmp_path / again.name / "log.txt").read_text()
    resumed_at = re.search(r"resumed at step (\d+)", log)
    assert resumed_at and 0 < int(resumed_at.group(1)) <= FAIL_AT, log[-2000:]
    assert_states_equal(canon(again.result()[0]), ref, what="resumed")


def vmapped_loop(specs: Sequence[xshare.JobSpec], capacity: int, steps: int) -> list:
    """The fused reference: ``jax.vmap`` of the step over ``capacity`` stacked states (empty
    slots hold copies of the first: a member does not depend on its neighbours), jitted with
    donation, in a plain loop. Arrays and Python numbers (a TrainState's ``step``, which jit
    makes an array) are stacked; other leaves (functions) stay static, as the runtime keeps them."""
    leaves, treedef = jax.tree.flatten(specs[0].state)
    dynamic = [_is_array(x) or isinstance(x, (int, float, complex)) for x in leaves]
    static = [None if d else x for x, d in zip(leaves, dynamic)]

    def unsplit(dyn: list) -> Any:
        it = iter(dyn)
        return jax.tree.unflatten(treedef, [next(it) if d else s for d, s in zip(dynamic, static)])

    def flat_step(dyn: list, batch: Any) -> tuple[list, Any]:
        new, metrics = specs[0].fn(unsplit(dyn), batch)
        return [x for x, d in zip(jax.tree.leaves(new), dynamic) if d], metrics

    def dyn_of(spec: xshare.JobSpec) -> list:
        return [jnp.array(x, copy=True) for x, d in zip(jax.tree.leaves(spec.state), dynamic) if d]

    slots = [dyn_of(s) for s in specs] + [dyn_of(specs[0])] * (capacity - len(specs))
    stacked = [jnp.stack(xs) for xs in zip(*slots)]
    f = jax.jit(jax.vmap(flat_step), donate_argnums=0)
    fill = [specs[0]] * (capacity - len(specs))
    for k in range(steps):
        batches = [s.data(k) for s in list(specs) + fill]
        stacked, _ = f(stacked, jax.tree.map(lambda *xs: np.stack(xs), *batches))
    return [unsplit([x[i] for x in stacked]) for i in range(len(specs))]


MULTI_STEPS, MULTI_K = 40, 4


def check_multistep(make_spec: Callable[[int], xshare.JobSpec], ref: Any,
                    canon: Callable[[Any], Any] = lambda s: s, *,
                    policies: Sequence[str] = xshare.POLICIES) -> None:
    """Run ``make_spec(MULTI_STEPS)`` with ``steps_per_call=MULTI_K`` under every policy: it ran
    steps MULTI_K per call (after its warm-up and the exactness check) and ends bit-identical to
    ``ref`` (the reference after MULTI_STEPS steps). A first runtime compiles the K-step program
    (in the background, as always; ``close`` waits for the pool) so the runs after it adopt it."""
    # Warm-up runs: the first compiles the first form; where the check does not keep it (a rolled
    # loop that is not bit-identical, as for a small CNN on CPU) the next run compiles the next.
    for _ in range(3):
        with xshare.Runtime(memory="512MiB", steps_per_call=MULTI_K, quantum=MULTI_K) as rt:
            warm = rt.submit(make_spec(MULTI_STEPS))
            rt.wait()
            rt._tier_pool.shutdown(wait=True)  # (close does not wait for background compiles)
        if warm._rec.tier is not None and warm._rec.tier.steps_at.get(MULTI_K):
            break
    for policy in policies:
        # (quantum: under srtf and priority a call is capped near 2 ms of device time, fewer
        # steps than MULTI_K on a loaded machine, unless the job keeps the device that long)
        handles, _ = run([make_spec(MULTI_STEPS)], policy=policy, steps_per_call=MULTI_K, quantum=MULTI_K)
        tier = handles[0]._rec.tier
        assert tier is not None and tier.steps_at.get(MULTI_K, 0) > 0, \
            f"under {policy} no call ran {MULTI_K} steps: {tier and tier.steps_at} {tier and tier.note}"
        assert_states_equal(canon(handles[0].result()[0]), ref, what=f"{MULTI_K} steps per call under {policy}")


class Checks:
    """The checks above as tests, for each users'-code module's ``TestUnderTheRuntime`` to inherit.

    The subclass sets, as staticmethods, the module's ``spec(seed, steps=STEPS, batches=None)``,
    ``reference(seed, steps=STEPS)`` (the final state run the reference way) and ``data(seed)``;
    ``canon`` where the result is not the reference's pytree (``nnx.state`` for an NNX job), and
    ``fused_tolerance`` where a vmapped step may differ more (bfloat16).
    """

    spec: Callable[..., xshare.JobSpec]
    reference: Callable[..., Any]
    data: Callable[[int], Callable[[int], Any]]
    canon: Callable[[Any], Any] = staticmethod(lambda s: s)
    fused_tolerance = 1e-5

    @pytest.mark.parametrize("policy", xshare.POLICIES)
    def test_bit_identical_to_the_reference_under_every_policy(self, policy):
        check_policy(policy, [self.spec(0), self.spec(1)], [self.reference(0), self.reference(1)], self.canon)

    def test_fused_sweep(self):
        check_fused([self.spec(0), self.spec(1)], [self.reference(0), self.reference(1)], self.canon,
                    tolerance=self.fused_tolerance)

    def test_checkpointed_and_resumed(self, tmp_path):
        check_resume(tmp_path, lambda b: self.spec(0, RESUME_STEPS, b), self.data(0),
                     self.reference(0, RESUME_STEPS), self.canon)

    @pytest.mark.parametrize("policies", [("pack", "srtf"), pytest.param(xshare.POLICIES, marks=pytest.mark.slow)],
                             ids=["pack-srtf", "every-policy"])
    def test_several_steps_per_call_bit_identical(self, policies):
        check_multistep(lambda steps: self.spec(0, steps), self.reference(0, MULTI_STEPS), self.canon,
                        policies=policies)
