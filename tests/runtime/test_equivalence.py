"""The strongest test of a sharing runtime: a job under xshare ends in exactly the state the same
step reaches in a plain loop, whatever the policy and the interleaving."""

from __future__ import annotations

import pytest
from flax import nnx

import xshare
from xshare.models import mlp
from tests.helpers import assert_trees_equal, plain_loop


@pytest.mark.parametrize("policy", xshare.POLICIES)
def test_three_mlps_interleaved_match_plain_loops_bit_for_bit(policy):
    specs = [mlp.make_job(width=w, depth=2, batch=32, steps=25, seed=i, name=f"w{w}")
             for i, w in enumerate((16, 48, 96))]
    with xshare.Runtime(policy=policy, memory="512MiB") as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    for spec, handle in zip(specs, handles):
        (model, optimizer), metrics = handle.result()   # the zoo's jobs are xshare.nnx jobs
        ref_state, ref_metrics = plain_loop(spec)
        assert_trees_equal(nnx.state((model, optimizer)), ref_state)
        assert metrics["loss"] == float(ref_metrics["loss"])
        assert handle.progress().steps_done == 25

