"""Orbax checkpoints: a user restores a job's state with plain Orbax (in a process that never
imports xshare), ``keep`` bounds the steps kept, resume is bit-exact under every policy, and a
checkpoint of the previous format (checkpoint.msgpack) still resumes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from xshare.runtime.observe import checkpoint, checkpoint_msgpack
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop


@xshare.job
def noisy_step(state, batch):
    """A regression step that draws from a typed PRNG key it carries in its state."""
    key, sub = jax.random.split(state["key"])
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
    w = state["w"] - 0.05 * g + 1e-3 * jax.random.normal(sub, state["w"].shape)
    return {"w": w, "key": key, "n": state["n"] + 1}, {"loss": loss}


def noisy_state():
    return {"w": jnp.ones((8, 1), jnp.float32), "key": jax.random.key(7), "n": jnp.zeros((), jnp.int32)}


# What a user writes in a notebook: plain Orbax, the job's initial state as the target. This
# runs in a fresh interpreter that never imports xshare (the test checks it did not).
RESTORE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp

    state = {"w": jnp.ones((8, 1), jnp.float32), "key": jax.random.key(7), "n": jnp.zeros((), jnp.int32)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    mngr = ocp.CheckpointManager(sys.argv[1])
    for i, which in enumerate(sys.argv[3:]):
        step = mngr.latest_step() if which == "latest" else int(which)
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))

        got = restored.state
        assert jax.tree.structure(got) == jax.tree.structure(state), jax.tree.structure(got)
        assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key), got["key"].dtype
        np.savez(f"{sys.argv[2]}-{i}.npz", step=step, w=got["w"], key=jax.random.key_data(got["key"]),
                 n=got["n"], impl=str(jax.random.key_impl(got["key"])))
    mngr.close()
    assert "xshare" not in sys.modules
""")


def _plain_orbax_restore(path, steps, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", RESTORE, str(path), str(tmp_path / "restored"),
                           *map(str, steps)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(np.load(tmp_path / f"restored-{i}.npz")) for i in range(len(steps))]


def test_plain_orbax_restores_the_exact_state_at_each_kept_step(tmp_path):
    spec = noisy_step.bind(noisy_state(), _slow(linreg_data(seed=3), 0.01), steps=35, name="nb")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=5, checkpoint_keep=2) as rt:
        rt.submit(spec)
    path = tmp_path / "nb" / checkpoint.FILENAME
    kept = checkpoint.steps(path)
    # keep=2: the older steps were deleted (a save still queued when the job's next one came
    # was skipped, so which mid-run steps exist depends on the machine's speed)
    assert len(kept) == 2 and kept[-1] == 35 and kept[0] % 5 == 0, kept
    for step, got in zip((kept[0], "latest"), _plain_orbax_restore(path, (kept[0], "latest"), tmp_path)):
        want = plain_loop(spec, steps=int(got["step"]))[0]
        assert int(got["step"]) == (kept[0] if step != "latest" else 35)
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["key"], jax.random.key_data(want["key"]))
        assert str(got["impl"]) == str(jax.random.key_impl(want["key"]))
        assert int(got["n"]) == int(got["step"])


def test_checkpoint_keep_is_checked(capsys):
    with pytest.raises(ValueError, match="checkpoint_keep=0 must be an int >= 1"):
        xshare.Runtime(memory="64MiB", checkpoint_keep=0)
    from xshare.cli.main import main
    assert main(["launch", "--checkpoint-keep", "0"]) == 2
    assert "--checkpoint-keep 0 must be >= 1" in capsys.readouterr().err


def _assert_equal(a, b):
    """Equal trees, typed PRNG keys compared by impl and key data."""
    def plain(tree):
        return jax.tree.map(lambda x: (str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
                            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
    assert_trees_equal(plain(a), plain(b))


def _slow(data, delay=0.003):
    def slow(step):
        time.sleep(delay)
        return data(step)
    return slow


@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.slow) if p != "srtf" else p
                                    for p in ("fifo", "pack", "srtf", "fair", "priority")])
def test_stop_and_resume_is_bit_exact_under_every_policy(tmp_path, policy):
    def specs():
        return [noisy_step.bind(noisy_state(), _slow(linreg_data(seed=i)), steps=60, name=f"p{i}", priority=i)
                for i in range(2)]
    rt = xshare.Runtime(policy=policy, memory="64MiB", log_dir=tmp_path, checkpoint_every=4)
    handles = rt.submit_many(specs())
    while max(h.progress().steps_done for h in handles) < 12:
        time.sleep(0.005)
    rt.stop()
    rt.close()
    assert any(0 < len(checkpoint.steps(tmp_path / h.name / checkpoint.FILENAME)) for h in handles)
    with xshare.Runtime(policy=policy, memory="64MiB", log_dir=tmp_path, resume=True) as rt2:
        resumed = rt2.submit_many(specs())
    for spec, h in zip(specs(), resumed):
        assert h.status() == "done"
        _assert_equal(h.result()[0], plain_loop(spec)[0])


def test_a_checkpoint_of_the_previous_format_still_resumes(tmp_path):
    spec = linreg_step.bind(linreg_state(seed=2), linreg_data(seed=2), steps=40, name="old")
    at_17 = plain_loop(spec, steps=17)[0]
    # what xshare wrote before its checkpoints were Orbax's
    checkpoint_msgpack.save(tmp_path / "old" / checkpoint_msgpack.FILENAME, step=17, state=at_17,
                            metrics={"loss": 1.0}, done=False)
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True, checkpoint_every=10) as rt:
        h = rt.submit(spec)
    assert_trees_equal(h.result()[0], plain_loop(spec)[0])
    assert "resumed at step 17" in (tmp_path / "old" / "log.txt").read_text()
    # from here on its checkpoints are Orbax's: a second resume reads those
    assert checkpoint.steps(tmp_path / "old" / checkpoint.FILENAME)[-1] == 40
    saved = checkpoint.load(tmp_path / "old" / checkpoint.FILENAME, spec.state, job="old")
    assert saved.done and saved.step == 40


def test_a_torn_step_is_refused_with_what_to_delete(tmp_path):
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=10, name="torn")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=5) as rt:
        rt.submit(spec)
    path = tmp_path / "torn" / checkpoint.FILENAME
    (path / "10" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(xshare.XShareError, match="delete .*10 to resume from the step before it"):
        checkpoint.load(path, spec.state, job="torn")


def test_a_runtime_that_does_not_checkpoint_never_imports_orbax(tmp_path):
    # Orbax's first import costs about half a second (more on a busy machine): only runtimes
    # that checkpoint pay it. (A fresh interpreter: this one imported Orbax long ago.)
    code = textwrap.dedent(f"""
        import sys, numpy as np, jax.numpy as jnp
        import xshare

        @xshare.job
        def step(w, batch):
            return w * 0.5, {{"loss": jnp.sum(w)}}

        with xshare.Runtime(memory="64MiB", log_dir={str(tmp_path)!r}) as rt:
            rt.submit(step.bind(jnp.ones(3), lambda k: np.ones(1, np.float32), steps=5)).result()
        assert not [m for m in sys.modules if m.startswith("orbax")], "orbax was imported"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_job_run_again_without_resume_replaces_the_steps_of_its_previous_run(tmp_path):
    first = linreg_step.bind(linreg_state(seed=1), linreg_data(seed=1), steps=20, name="again")
    second = linreg_step.bind(linreg_state(seed=2), linreg_data(seed=2), steps=20, name="again")
    for spec in (first, second):
        with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=5) as rt:
            rt.submit(spec)
    saved = checkpoint.load(tmp_path / "again" / checkpoint.FILENAME, second.state, job="again")
    assert saved.done and saved.step == 20
    assert_trees_equal(saved.state, plain_loop(second)[0])  # not the first run's step 20
