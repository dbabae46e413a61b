"""The batcher as Triton names it: no delay by default, preferred batch sizes, priority levels
and per-request ``priority`` and ``timeout`` (a request past its timeout fails alone), in process
and through tritonclient's own parameters over HTTP and gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import xshare
from tests.serving.conftest import D_IN, direct_mlp, mlp_params, mlp_predict, rows
from tests.serving.test_grpc import both  # noqa: F401

WAIT = 600_000  # ms: a batch that is not full or preferred never falls due within a test


def spec(name: str, **kw) -> xshare.ModelSpec:
    return xshare.model(mlp_predict, mlp_params(), inputs={"x": ("float32", (D_IN,))}, name=name, **kw)


def test_the_default_batcher_does_not_delay():
    s = xshare.model(mlp_predict, mlp_params(), inputs={"x": ("float32", (D_IN,))}, name="m")
    assert s.max_delay_ms == 0.0 and s.preferred_batch_sizes == () and s.priority_levels == 0
    with pytest.raises(ValueError, match=r"preferred_batch_sizes=\(32,\) must be row counts in 1..max_batch=16"):
        spec("m", max_batch=16, preferred_batch_sizes=(32,))
    with pytest.raises(ValueError, match=r"default_priority_level=3 must be in 1..priority_levels=2"):
        spec("m", priority_levels=2, default_priority_level=3)


def test_a_preferred_batch_size_runs_at_once(both):
    m = both.deploy(spec("pref", max_batch=8, buckets=(4, 8), max_delay_ms=WAIT, preferred_batch_sizes=(4,)))
    first = [m.submit({"x": rows(1, seed=k)}) for k in range(4)]  # 1+1+1+1 = 4 rows: preferred, due now
    got = np.concatenate([f.result(30)["y"] for f in first])
    np.testing.assert_array_equal(got, direct_mlp(np.concatenate([rows(1, seed=k) for k in range(4)]), bucket=4)["y"])
    late = [m.submit({"x": rows(3, seed=5)}), m.submit({"x": rows(3, seed=6)})]  # 3, 6: no preferred prefix
    assert not any(f.done() for f in late)
    last = m.submit({"x": rows(2, seed=7)})  # 8 rows: a full batch
    for f, x in zip([*late, last], (rows(3, seed=5), rows(3, seed=6), rows(2, seed=7))):
        assert f.result(30)["y"].shape == (len(x), 4)
    assert sorted(m.triton_stats()["batches"]) == [4, 8]  # one batch of each, nothing else
    config = httpclient.InferenceServerClient(both.status_server.address).get_model_config("pref")
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": WAIT * 1000, "preferred_batch_size": [4]}


def test_a_higher_priority_request_is_taken_first(both):
    m = both.deploy(spec("prio", max_batch=2, buckets=(2,), max_delay_ms=WAIT, priority_levels=2,
                         default_priority_level=2))
    low = m.submit({"x": rows(1, seed=1)})  # the default level, 1 of 2 rows: waits
    high = m.submit({"x": rows(2, seed=2)}, priority=1)  # goes in front; 2 rows fill the batch alone
    np.testing.assert_array_equal(high.result(30)["y"], direct_mlp(rows(2, seed=2), bucket=2)["y"])
    # in arrival order the batch would have been `low` alone (the 2 rows do not fit beside it)
    assert not low.done()
    both.undeploy("prio")  # answers what waits
    assert low.result(30)["y"].shape == (1, 4)
    with pytest.raises(xshare.InferError, match="priority 3 is not a level of model 'p2': 1 \\(highest\\) .. 2"):
        both.deploy(spec("p2", max_batch=2, priority_levels=2)).submit({"x": rows(1)}, priority=3)
    with pytest.raises(xshare.InferError, match="model 'mlp' has no priority levels"):
        both.model("mlp").submit({"x": rows(1)}, priority=1)


def test_a_request_past_its_timeout_fails_alone(both):
    m = both.deploy(spec("slowq", max_batch=4, buckets=(4,), max_delay_ms=WAIT))
    patient = m.submit({"x": rows(1, seed=1)})
    hasty = m.submit({"x": rows(1, seed=2)}, timeout_us=20_000)
    with pytest.raises(xshare.InferError, match=r"waited \d+\.\d ms in the queue of model 'slowq', past its "
                                                r"timeout of 20000 us; it did not run") as info:
        hasty.result(30)
    assert info.value.code == 504 and not patient.done()
    rest = m.submit({"x": rows(3, seed=3)})  # 1 + 3 rows: the batch, without the expired request
    batch = np.concatenate([rows(1, seed=1), rows(3, seed=3)])
    np.testing.assert_array_equal(patient.result(30)["y"], direct_mlp(batch)["y"][:1])
    np.testing.assert_array_equal(rest.result(30)["y"], direct_mlp(batch)["y"][1:])
    stats = m.triton_stats()
    assert stats["fail"][0] == 1 and stats["success"][0] == 2 and list(stats["batches"]) == [4]


def test_tritonclient_sends_priority_and_timeout_over_http_and_grpc(both):
    both.deploy(spec("tc", max_batch=4, buckets=(4,), max_delay_ms=WAIT, priority_levels=3))
    x = rows(1)
    h = httpclient.InferenceServerClient(both.status_server.address)
    g = grpcclient.InferenceServerClient(both.grpc_server.address)
    try:
        i = httpclient.InferInput("x", [1, D_IN], "FP32")
        i.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="past its timeout of 30000 us") as info:
            h.infer("tc", [i], timeout=30_000, priority=2)
        assert info.value.status() == "504"
        gi = grpcclient.InferInput("x", [1, D_IN], "FP32")
        gi.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="past its timeout of 30000 us") as info:
            g.infer("tc", [gi], timeout=30_000, priority=1)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        with pytest.raises(InferenceServerException, match="priority 7 is not a level of model 'tc'") as info:
            g.infer("tc", [gi], priority=7)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert both.model("tc").triton_stats()["fail"][0] == 2  # both timed out, nothing ran
        batching = g.get_model_config("tc", as_json=True)["config"]["dynamic_batching"]
        assert batching["priority_levels"] == "3" and batching["default_priority_level"] == "2"
    finally:
        h.close()
        g.close()
