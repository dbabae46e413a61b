"""Host swap: a paused job's state moves to host memory to admit another, and comes back
unchanged."""

from __future__ import annotations

import time

import jax

import xshare
from xshare.runtime.engine.states import JobState
from xshare.runtime.compiled.compiler import compile_step
from tests.helpers import assert_trees_equal, heavy_data, heavy_state, heavy_step, plain_loop


def _footprint(spec, staged=2 + 2):
    # The runtime charges prefetched (2) and in-flight (dispatch_ahead, 2 below) batches.
    first = spec.data(0)
    return compile_step(spec.job, spec.state, first, device=jax.devices()[0], prefetch=staged).footprint


def test_offloading_a_paused_job_admits_a_queued_one_and_results_are_unchanged():
    a = heavy_step.bind(heavy_state(dim=512, seed=0), heavy_data(dim=512, batch=64, seed=0),
                        steps=100, name="a")
    c = heavy_step.bind(heavy_state(dim=512, seed=1), heavy_data(dim=512, batch=64, seed=1),
                        steps=30, name="c")
    fp = _footprint(a)
    # Room for one such job and a bit, never two: c must queue behind a.
    memory = fp.total + fp.persistent // 2
    with xshare.Runtime(policy="pack", memory=memory, dispatch_ahead=2) as rt:
        ha = rt.submit(a)
        while ha.progress().steps_done < 10:
            time.sleep(0.002)
        ha.pause()
        hc = rt.submit(c)
        while hc.status() == "compiling":  # submit returns at once; c is compiled off-thread
            time.sleep(0.002)
        assert hc.status() == "queued"
        assert ha.state is JobState.PAUSED
        ha.pause(offload=True)
        hc.wait(timeout=60)
        assert hc.status() == "done"
        assert ha.status() == "paused" and ha.state is JobState.SWAPPED
        paused_at = ha.progress().steps_done
        ha.resume()
        ha.wait(timeout=60)
    assert 10 <= paused_at < 100
    assert ha.status() == "done"
    assert_trees_equal(ha.result()[0], plain_loop(a)[0])
    assert_trees_equal(hc.result()[0], plain_loop(c)[0])
    # c only ran after a's state left the device: the arena never held both.
    assert rt.peak_in_flight_bytes <= memory
