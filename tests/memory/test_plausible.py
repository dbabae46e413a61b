"""Admission does not trust a zero: hand-made analyses and HLO texts, and one real program."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from xshare.memory.footprint import footprint_from_analysis
from xshare.memory.plausible import above_measured, implausible_temp, shape_bytes, temp_bound

# A small optimized module as XLA prints it: a fused computation (its insides never
# materialize), a while loop whose body computes a buffer, and the entry.
HLO = """HloModule jit_step, is_scheduled=true

%fused_computation (param_0: f32[64,128]) -> f32[64,128] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  ROOT %tanh.0 = f32[64,128]{1,0} tanh(%param_0)
}

%body (p: (s32[], f32[128])) -> (s32[], f32[128]) {
  %p = (s32[], f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[128]{0} get-tuple-element(%p), index=1
  %w = f32[128]{0} multiply(%v, %v)
  ROOT %t = (s32[], f32[128]{0}) tuple(%i, %w)
}

ENTRY %main.9 (Arg_0.1: f32[32,128], Arg_1.2: f32[64,32]) -> (f32[32,128], f32[]) {
  %Arg_0.1 = f32[32,128]{1,0} parameter(0)
  %Arg_1.2 = f32[64,32]{1,0} parameter(1)
  %dot.3 = f32[64,128]{1,0} dot(%Arg_1.2, %Arg_0.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fusion = f32[64,128]{1,0} fusion(%dot.3), kind=kLoop, calls=%fused_computation
  %gemm = (f32[64,128]{1,0}, s8[1024]{0}) custom-call(%fusion, %Arg_0.1), custom_call_target="__cublas$gemm"
  %c = f32[] constant(0)
  %bc = f32[128,32]{1,0} bitcast(%Arg_0.1)
  ROOT %tuple = (f32[32,128]{1,0}, f32[]) tuple(%Arg_0.1, %c)
}
"""


def analysis(arg, out, alias, temp):
    return SimpleNamespace(argument_size_in_bytes=arg, output_size_in_bytes=out,
                           alias_size_in_bytes=alias, temp_size_in_bytes=temp,
                           generated_code_size_in_bytes=0)


@pytest.mark.parametrize("shape, nbytes", [
    ("f32[64,128]{1,0}", 64 * 128 * 4),
    ("bf16[3]", 6),
    ("pred[]", 1),
    ("(f32[64,128]{1,0}, s8[1024]{0})", 64 * 128 * 4 + 1024),  # a tuple: summed
])
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_temp_bound_counts_materialized_intermediates_only():
    bound = temp_bound(HLO)
    # dot.3, fusion, the gemm's tuple (result + workspace) and the loop body's multiply; not
    # the fusion's insides, parameters, constants, bitcasts, tuples or the entry's result.
    assert bound.buffers == 4
    assert bound.bytes == 2 * 64 * 128 * 4 + (64 * 128 * 4 + 1024) + 128 * 4


def test_a_zero_temp_for_a_program_with_intermediates_is_replaced_by_the_bound(caplog):
    caplog.set_level(logging.WARNING, logger="xshare.memory")
    fp = footprint_from_analysis(analysis(arg=24576, out=16388, alias=16384, temp=0),
                                 state_bytes=16384, batch_bytes=8192, prefetch=0, job="j",
                                 hlo=lambda: HLO)
    bound = temp_bound(HLO).bytes
    assert fp.temp == bound
    assert fp.ephemeral == bound + 8192 + 4
    assert "reported 0 temporary bytes for a program with 4 intermediate buffers" in fp.note
    assert "jax #18954" in fp.note
    assert [r.getMessage() for r in caplog.records] == [f"xshare: job 'j': {fp.note}"]


def test_a_nonzero_temp_is_xla_s_and_the_hlo_is_not_read():
    def unread():
        raise AssertionError("the HLO text was generated although temp > 0")

    fp = footprint_from_analysis(analysis(arg=24576, out=16388, alias=16384, temp=4096),
                                 state_bytes=16384, batch_bytes=8192, prefetch=0, hlo=unread)
    assert fp.temp == 4096 and fp.note is None


def test_a_zero_temp_is_believed_for_a_program_without_intermediates():
    hlo = ("ENTRY %main (a: f32[4]) -> f32[4] {\n  %a = f32[4]{0} parameter(0)\n"
           "  ROOT %add = f32[4]{0} add(%a, %a)\n}\n")
    assert implausible_temp(0, hlo) is None
    fp = footprint_from_analysis(analysis(arg=16, out=16, alias=16, temp=0), state_bytes=16,
                                 batch_bytes=0, prefetch=0, hlo=lambda: hlo)
    assert fp.temp == 0 and fp.note is None


def test_a_measured_peak_above_the_prediction_is_the_bound():
    assert above_measured(1000, None) is None
    assert above_measured(1000, 900) is None
    charge, why = above_measured(1000, 5000)
    assert charge == 5000 and "measured peak of 4.9 KiB is above memory_analysis()'s 1000 B" in why


def test_a_real_program_on_cpu_keeps_xla_s_figure():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def step(w, x):
        return w - 0.1 * jnp.tanh(x @ w).T @ x / 8, jnp.sum(w)

    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    compiled = jax.jit(step, donate_argnums=0).lower(w, x).compile()
    ma = compiled.memory_analysis()
    bound = temp_bound(compiled.as_text())
    assert bound.buffers > 0 and 0 < ma.temp_size_in_bytes <= bound.bytes  # a bound, and plausible
    fp = footprint_from_analysis(ma, state_bytes=w.nbytes, batch_bytes=x.nbytes, prefetch=0,
                                 hlo=compiled.as_text)
    assert fp.note is None and fp.temp == ma.temp_size_in_bytes
