"""``Runtime(keep_results=False)``: a done job's final state is kept in its final checkpoint
only (as ``xshare serve`` runs), ``result()`` reads back exactly the state the job ended in, a
final checkpoint that could not be written releases nothing, and a checkpoint deleted later is
named in the error."""

from __future__ import annotations

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import xshare
from xshare._errors import XShareError
from xshare.models import mlp
from xshare.runtime.observe import checkpoint
from tests.helpers import assert_trees_equal, linreg_data, plain_loop


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))


@xshare.job
def linen_step(state, batch):
    """A TrainState step as the Flax docs write it: optax.adam(lr) baked into ``state.tx``."""
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


@xshare.job
def keyed_step(state, batch):
    """A dict state that carries a typed PRNG key and an int counter."""
    key, sub = jax.random.split(state["key"])
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
    return {"w": state["w"] - 0.05 * g + 1e-3 * jax.random.normal(sub, state["w"].shape), "key": key,
            "n": state["n"] + 1}, {"loss": loss}


def specs(steps: int = 30) -> list:
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    keyed = {"w": jnp.ones((8, 1), jnp.float32), "key": jax.random.key(7), "n": jnp.zeros((), jnp.int32)}
    return [linen_step.bind(ts, linreg_data(seed=1), steps=steps, name="linen"),
            keyed_step.bind(keyed, linreg_data(seed=2), steps=steps, name="keyed"),
            mlp.make_job(width=16, batch=8, steps=steps, name="nnx")]  # an xshare.nnx job


def assert_same(a, b) -> None:
    """``assert_trees_equal`` with typed PRNG keys compared by their key data."""
    def data(tree):
        return jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
            getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else x, tree)
    assert_trees_equal(data(a), data(b))


def nnx_leaves(result) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(result))]


def test_a_done_jobs_final_state_stays_only_on_disk_and_result_reads_back_the_exact_one(tmp_path):
    jobs = specs()  # (one set of specs: a TrainState's apply_fn and tx are part of its structure)
    with xshare.Runtime(memory="256MiB", policy="pack") as rt:  # the default: kept in memory
        kept = {h.name: h.result() for h in rt.submit_many(jobs)}
    with xshare.Runtime(memory="256MiB", policy="pack", checkpoint_dir=tmp_path, keep_results=False) as rt:
        handles = rt.submit_many(jobs)
        rt.wait()
    for h in handles:  # (the recorder wrote every final checkpoint before the runtime closed)
        assert h._rec.host_state is None and h._rec.on_disk.step == 30, h.name
        assert h._rec.on_disk.path == checkpoint.path_for(tmp_path, h.name)
        treedef, leaves = h._rec.on_disk.like
        assert all(x.strides == (0,) * x.ndim for x in leaves if isinstance(x, np.ndarray)), \
            "the structure kept holds no array's data"
    got = {h.name: h.result() for h in handles}
    for spec in jobs[:2]:  # equal to the plain jax.jit loop of the same code, bit for bit
        want, _ = plain_loop(spec)
        assert_same(got[spec.name][0], want)
        assert_same(got[spec.name][0], kept[spec.name][0])
        assert got[spec.name][1] == kept[spec.name][1]
    assert isinstance(got["linen"][0], train_state.TrainState) and got["linen"][0].step == 30
    assert jax.dtypes.issubdtype(got["keyed"][0]["key"].dtype, jax.dtypes.prng_key)
    (model, optimizer), metrics = got["nnx"]  # new NNX objects, as with the state in memory
    (model_kept, optimizer_kept), metrics_kept = kept["nnx"]
    assert isinstance(model, nnx.Module) and metrics == metrics_kept
    for a, b in zip(nnx_leaves((model, optimizer)), nnx_leaves((model_kept, optimizer_kept))):
        np.testing.assert_array_equal(a, b)


def test_a_final_checkpoint_that_could_not_be_written_releases_nothing(tmp_path):
    (tmp_path / "keyed").write_text("a file where the job's checkpoint directory would go")
    spec = specs()[1]
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path, keep_results=False) as rt:
        h = rt.submit(spec)
        rt.wait()
    assert h._rec.on_disk is None and h._rec.host_state is not None
    assert_same(h.result()[0], plain_loop(spec)[0])  # the work is not lost


def test_result_names_the_final_checkpoint_deleted_after_the_job_ended(tmp_path):
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path, keep_results=False) as rt:
        h = rt.submit(specs()[1])
    shutil.rmtree(tmp_path / "keyed")
    with pytest.raises(XShareError) as err:
        h.result()
    msg = str(err.value)
    assert "keep_results=False" in msg and str(checkpoint.path_for(tmp_path, "keyed")) in msg
    assert "step 30" in msg and "deleted or replaced" in msg and "keep_results=True" in msg


def test_a_job_resumed_already_done_keeps_its_state_on_disk_too(tmp_path):
    spec = specs()[1]
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path, keep_results=False) as rt:
        rt.submit(spec)
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path, resume=True, keep_results=False) as rt:
        h = rt.submit(spec)
        rt.wait()
    assert h.status() == "done" and h._rec.host_state is None and h._rec.on_disk.step == 30
    assert_same(h.result()[0], plain_loop(spec)[0])


def test_keep_results_false_without_a_checkpoint_dir_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"keep_results=False needs a checkpoint_dir.*checkpoint_dir=\.\.\."):
        xshare.Runtime(memory="64MiB", keep_results=False)
    with pytest.raises(ValueError, match=r"keep_results='no' must be True"):
        xshare.Runtime(memory="64MiB", keep_results="no")


def test_xshare_serve_keeps_no_final_state_in_memory(tmp_path):
    from xshare.jobs import JobRequest
    from xshare.service.service import Service

    svc = Service(run_dir=tmp_path, memory="256MiB")
    try:
        req = JobRequest(entry="xshare.models.mlp:make_job", steps=20, params={"width": 16, "batch": 8})
        (name,), (h,) = svc.submit([req])
        h.wait(60)
        svc.rt.recorder.flush()
        assert h.status() == "done" and h._rec.host_state is None and h._rec.on_disk.step == 20
        saved = checkpoint.load(checkpoint.path_for(tmp_path, name), jax.tree.unflatten(*h._rec.on_disk.like), job=name)
        for a, b in zip(nnx_leaves(h.result()[0]), jax.tree.leaves(saved.state)):
            np.testing.assert_array_equal(a, np.asarray(b))
    finally:
        svc.stop()


def test_fused_members_release_their_final_states_too(tmp_path):
    jobs = [mlp.make_job(width=16, batch=8, steps=25 + 5 * i, lr=1e-3 * (i + 1), name=f"m{i}") for i in range(3)]
    with xshare.Runtime(memory="256MiB", fuse="always") as rt:
        kept = [h.result() for h in rt.submit_many(jobs)]
    with xshare.Runtime(memory="256MiB", fuse="always", checkpoint_dir=tmp_path, keep_results=False) as rt:
        handles = rt.submit_many(jobs)
        rt.wait()
        assert rt.snapshot()["runtime"]["fused_member_steps"] > 0
    for h, (want, metrics) in zip(handles, kept):
        assert h._rec.host_state is None and h._rec.on_disk.step == h.progress().steps_done
        got, got_metrics = h.result()
        assert got_metrics == metrics
        for a, b in zip(nnx_leaves(got), nnx_leaves(want)):
            np.testing.assert_array_equal(a, b)


def test_released_states_pages_go_back_to_the_os_and_nothing_is_trimmed_when_states_are_kept(tmp_path, monkeypatch):
    from xshare.runtime.observe import released

    trims = []
    monkeypatch.setattr(released, "trim", lambda: trims.append(1))
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path / "kept") as rt:
        rt.submit(specs()[1])
    assert trims == []  # (keep_results=True: nothing released, nothing to trim)
    with xshare.Runtime(memory="64MiB", checkpoint_dir=tmp_path / "released", keep_results=False) as rt:
        rt.submit_many([s.replace(name=f"{s.name}{i}") for i, s in enumerate(specs()[:2])])
    assert 1 <= len(trims) <= 2  # after the releases (at most one trim a second: TRIM_EVERY_S)


def test_trim_hands_pages_back_or_does_nothing_where_there_is_no_glibc():
    from xshare.runtime.observe import released

    released.trim()  # (glibc here: malloc_trim(0); elsewhere a no-op; never raises)
    assert released._LIBC is False or callable(released._LIBC)
