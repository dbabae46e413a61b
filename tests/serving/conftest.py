"""Two small models served by a real runtime over real HTTP (tritonclient against the runtime's
status server), and the direct computation every answer is compared with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare

D_IN, HIDDEN, D_OUT = 16, 32, 4


def mlp_predict(params, inputs):
    h = jnp.tanh(inputs["x"] @ params["w1"] + params["b1"])
    return {"y": h @ params["w2"], "argmax": jnp.argmax(h @ params["w2"], axis=-1).astype(jnp.int32)}


def affine_predict(params, inputs):  # two inputs, one array output (named "output")
    return inputs["a"] * params["scale"] + inputs["b"].astype(jnp.float32)


def mlp_params(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"w1": np.asarray(jax.random.normal(k[0], (D_IN, HIDDEN))), "b1": np.zeros(HIDDEN, np.float32),
            "w2": np.asarray(jax.random.normal(k[1], (HIDDEN, D_OUT)))}


AFFINE_PARAMS = {"scale": np.arange(1, 4, dtype=np.float32)}


def mlp_spec(**kw):
    return xshare.model(mlp_predict, mlp_params(), inputs={"x": ("float32", (D_IN,))},
                        **{"name": "mlp", "max_batch": 16, "max_delay_ms": 20, **kw})


def affine_spec(**kw):
    return xshare.model(affine_predict, AFFINE_PARAMS, inputs={"a": ("float32", (3,)), "b": ("int32", (3,))},
                        **{"name": "affine", "max_batch": 8, "max_delay_ms": 2, "priority": 5, **kw})


_DIRECT = jax.jit(mlp_predict)


def served_bucket(n: int, buckets: tuple = (1, 4, 16)) -> int:
    """The padded batch size a lone request of ``n`` rows runs in (mlp_spec's default buckets)."""
    return min(b for b in buckets if b >= n)


def direct_mlp(x: np.ndarray, bucket: int | None = None) -> dict[str, np.ndarray]:
    """predict(params, x) computed directly, as a user would without xshare, over the rows as
    the runtime ran them: ``x`` zero-padded to ``bucket`` rows (default: the bucket a lone
    request of its size lands in), then cut back to its own rows. That is the bit-for-bit
    guarantee: XLA may pick another kernel for another row count (jax 0.12 does for this MLP),
    so predict over ``x`` alone agrees to rounding only (tests assert that apart)."""
    n = len(x)
    b = served_bucket(n) if bucket is None else bucket
    padded = np.concatenate([x, np.zeros((b - n, *x.shape[1:]), x.dtype)]) if b > n else x
    return {k: np.asarray(v)[:n] for k, v in _DIRECT(mlp_params(), {"x": padded}).items()}


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, D_IN)).astype(np.float32)


def serving_runtime(tmp_path, monkeypatch, **ports):
    """A runtime on free loopback ports (``status_port=0``, ``grpc_port=0``, ...) with both
    models deployed, closed after the test (a generator for fixtures to yield from)."""
    monkeypatch.setenv("XSHARE_RUNTIME_DIR", str(tmp_path / "runtimes"))
    rt = xshare.Runtime(policy="pack", memory="256MiB", **ports)
    try:
        rt.deploy(mlp_spec())
        rt.deploy(affine_spec())
        yield rt
    finally:
        rt.close()


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A runtime with a status server on a free loopback port and both models deployed."""
    yield from serving_runtime(tmp_path, monkeypatch, status_port=0)


@pytest.fixture
def client(served):
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(served.status_server.address, concurrency=8)
    yield c
    c.close()


def infer_input(module, x: np.ndarray, name: str = "x", dtype: str = "FP32"):
    """A tritonclient input (``module``: tritonclient.http or tritonclient.grpc) holding ``x``."""
    i = module.InferInput(name, list(x.shape), dtype)
    i.set_data_from_numpy(x)
    return i


def send_request(client, module, name: str = "x", dtype: str = "FP32", x: np.ndarray | None = None, model: str = "mlp"):
    """One request through ``client`` (of tritonclient ``module``): input ``name`` holding ``x``
    (``rows(2)`` by default) as ``dtype``, to ``model``; the bad-request tests vary one of them."""
    return client.infer(model, [infer_input(module, rows(2) if x is None else x, name, dtype)])


def infer_mlp(client, x: np.ndarray, *, binary: bool = True) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    i = httpclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("y", "argmax")]
    r = client.infer("mlp", [i], outputs=outs)
    # copies: tritonclient's arrays may view a response buffer that the next request reuses
    return {n: np.array(r.as_numpy(n)) for n in ("y", "argmax")}
