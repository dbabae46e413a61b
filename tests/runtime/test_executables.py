"""Programs kept whole beside the compilation cache (compiled/executables.py): a later process
(here: cleared in-process caches) loads a fused group's program, or a job's one-step program
keyed by its jaxpr, instead of lowering it, runs it once on zeros first, and ends in the state
the vmapped loop (the jit loop) reaches; a kept file that does not load is dropped and the
program compiled again; only fresh compiles are kept."""

from __future__ import annotations

import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import pytest

import xshare
from xshare import ffi
from xshare.runtime.compiled import compiler, fusion
from xshare.runtime.compiled.compiler import PROGRAMS
from xshare.runtime.compiled.program import jaxpr_identity
from xshare.runtime.compiled.executables import _HIT_EVENT, EXECUTABLES, FRESH, Executables
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop
from tests.users.harness import vmapped_loop

STEPS = 24


def specs():
    return [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=STEPS, name=f"k{i}")
            for i in range(3)]


def run_fused(cache) -> list:
    fusion._cache.clear()  # as in a new process: no group program in memory
    with xshare.Runtime(memory="256MiB", fuse="always", steps_per_call=1, compilation_cache=str(cache)) as rt:
        # Fenced (the canary passed on this machine): the trial call runs in the scratch ring.
        assert rt.fences == ffi.available()
        handles = rt.submit_many(specs())
        rt.wait()
    settle()
    return [h.result()[0] for h in handles]


def settle() -> None:
    """Wait for the slot moves compiling and the fresh copies being kept in the background."""
    for name in ("xshare-compile-moves", "xshare-keep-executable"):
        for t in threading.enumerate():
            if t.name == name:
                t.join()


def kept(cache) -> list:
    return sorted((cache / "executables").glob("*.xla"))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The process-wide store pointed at this test's cache, restored after it; slot moves
    compiled (and kept) as on an accelerator, not moved through numpy as a small CPU stack's
    are (fusion.HOST_MOVES_BYTES)."""
    monkeypatch.setattr(EXECUTABLES, "directory", EXECUTABLES.directory)
    monkeypatch.setattr(fusion, "HOST_MOVES_BYTES", -1)
    return tmp_path / "cache"


def test_a_small_cpu_stack_keeps_only_its_group_program(tmp_path, monkeypatch):
    """Its slots move through numpy: no move programs to compile or keep."""
    monkeypatch.setattr(EXECUTABLES, "directory", EXECUTABLES.directory)
    want = vmapped_loop(specs(), 4, STEPS)
    got = run_fused(tmp_path / "cache")
    assert len(kept(tmp_path / "cache")) == 1
    for g, w in zip(got, want):
        assert_trees_equal(g, w)


def test_a_kept_group_program_is_loaded_not_compiled_and_ends_where_the_vmapped_loop_does(store):
    want = vmapped_loop(specs(), 4, STEPS)
    first = run_fused(store)
    # Fresh compiles of this test's own cache, kept at once: the group program and its two
    # slot moves (fusion._moves)
    assert len(kept(store)) == 3
    loaded, compiles = EXECUTABLES.loaded, PROGRAMS.compiles
    second = run_fused(store)
    assert EXECUTABLES.loaded == loaded + 3
    # The group's program, loaded: counted as its program's compile, as an XLA cache hit is
    # (the solo program is still in memory: not built again).
    assert PROGRAMS.compiles == compiles + 1
    for a, b, w in zip(first, second, want):
        assert_trees_equal(a, w)
        assert_trees_equal(b, w)


def test_a_kept_file_that_does_not_load_is_dropped_and_compiled_again(store):
    want = vmapped_loop(specs(), 4, STEPS)
    run_fused(store)
    paths = kept(store)
    assert len(paths) == 3  # the group program and its slot moves
    for path in paths:
        path.write_bytes(b"not an executable")
    loaded = EXECUTABLES.loaded
    got = run_fused(store)
    assert EXECUTABLES.loaded == loaded  # none loaded: each compiled again
    # XLA's cache answered those compiles: fresh copies were kept in their place
    assert all(path.exists() and path.read_bytes() != b"not an executable" for path in paths)
    for g, w in zip(got, want):
        assert_trees_equal(g, w)


class FromXlaCache:
    """A lowering whose plain compile came from XLA's persistent cache (the event jax records)."""

    def __init__(self, lowered):
        self.lowered = lowered
        self.options = []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        if compiler_options is None:
            jax.monitoring.record_event(_HIT_EVENT)
        return self.lowered.compile(compiler_options=compiler_options)


def test_an_executable_xla_loaded_from_its_cache_is_not_kept_a_fresh_copy_is(tmp_path):
    store = Executables()
    store.persist(tmp_path)
    f = jax.jit(lambda x: (x * 2).sum())
    lowered = FromXlaCache(f.lower(jnp.ones(4)))
    device = jax.devices()[0]
    key = store.key("t", device=device)
    compiled, _, loaded = store.compile(key, lambda: lowered, device=device, nbytes=16,
                                        trial=lambda c: c(jnp.zeros(4)))
    assert not loaded and float(compiled(jnp.ones(4))) == 8.0
    settle()
    assert lowered.options[0] is None and lowered.options[1]  # then a fresh compile, another XLA key
    assert store.saved == 1 and (tmp_path / "executables" / f"{key}.xla").exists()
    again, _, loaded = store.compile(key, lambda: pytest.fail("lowered although kept"), device=device,
                                     nbytes=16, trial=lambda c: c(jnp.zeros(4)))
    assert loaded and float(again(jnp.ones(4))) == 8.0


def test_programs_too_large_for_a_trial_call_are_not_kept(tmp_path):
    store = Executables()
    store.persist(tmp_path)
    f = jax.jit(lambda x: x + 1)
    device = jax.devices()[0]
    store.compile("big", lambda: f.lower(jnp.ones(4)), device=device, nbytes=1 << 30,
                  trial=lambda c: pytest.fail("no trial for a program that is not kept"))
    assert store.saved == 0 and not (tmp_path / "executables").exists()


def test_a_kept_executable_whose_trial_call_raises_is_dropped_and_compiled_again(tmp_path):
    # What the CPU backend did with an executable XLA had loaded from its own cache: it
    # deserialized, and its first call raised (NOT_FOUND). The trial call meets that first.
    store = Executables()
    store.persist(tmp_path)
    f = jax.jit(lambda x: x * 3)
    device = jax.devices()[0]
    store.compile("k", lambda: f.lower(jnp.ones(4)), device=device, nbytes=16, trial=lambda c: c(jnp.zeros(4)))
    settle()
    path = tmp_path / "executables" / "k.xla"
    assert path.exists() and store.saved == 1

    def broken(compiled):
        raise RuntimeError("NOT_FOUND: Function multiply_bitcast_fusion not found")

    lowered = []
    compiled, _, loaded = store.compile("k", lambda: lowered.append(1) or f.lower(jnp.ones(4)), device=device,
                                        nbytes=16, trial=broken)
    assert not loaded and lowered == [1] and store.loaded == 0
    assert [float(v) for v in compiled(jnp.ones(4))] == [3.0] * 4
    settle()
    assert path.exists()  # compiled again and kept again (fresh, or a fresh copy)


def test_an_executable_xla_loaded_is_not_kept_as_it_is_when_jax_hands_it_out_again(tmp_path):
    # jax's in-memory cache hands the same executable out for the same lowering, this time
    # without XLA's cache-hit event: it is still the one XLA loaded, so a fresh copy is kept.
    store = Executables()
    store.persist(tmp_path)
    f = jax.jit(lambda x: (x * 5).sum())
    device = jax.devices()[0]
    first, _, _ = store.compile("a", lambda: FromXlaCache(f.lower(jnp.ones(4))), device=device, nbytes=1 << 30,
                                trial=lambda c: c(jnp.zeros(4)))  # (too large to keep: only its origin is noted)
    again = Recording(f.lower(jnp.ones(4)))
    compiled, _, _ = store.compile("b", lambda: again, device=device, nbytes=16, trial=lambda c: c(jnp.zeros(4)))
    settle()
    assert compiled._executable is first._executable  # (the premise: jax handed out the same one)
    assert float(compiled(jnp.ones(4))) == 20.0
    assert again.options == [None, FRESH]  # kept: the fresh copy, not the executable XLA loaded
    assert store.saved == 1 and (tmp_path / "executables" / "b.xla").exists()


class Recording(FromXlaCache):
    """A lowering whose compiles are recorded, with no cache-hit event."""

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        return self.lowered.compile(compiler_options=compiler_options)


def run_alone(cache) -> tuple:
    PROGRAMS.clear()  # as in a new process: no program in memory
    spec = linreg_step.bind(linreg_state(seed=7), linreg_data(seed=7), steps=STEPS, name="alone")
    with xshare.Runtime(memory="256MiB", policy="fifo", steps_per_call=1, compilation_cache=str(cache)) as rt:
        handle = rt.submit(spec)
        rt.wait()
        fenced = rt.fences
    settle()
    return handle.result()[0], fenced


def test_a_kept_one_step_program_is_loaded_without_lowering_and_ends_where_jit_does(store, monkeypatch):
    want = plain_loop(linreg_step.bind(linreg_state(seed=7), linreg_data(seed=7), steps=STEPS))[0]
    first, _ = run_alone(store)
    assert len(kept(store)) == 1  # its one-step program, a fresh compile
    loaded, lowered = EXECUTABLES.loaded, []
    real = compiler.lower_fenced
    monkeypatch.setattr(compiler, "lower_fenced", lambda *a: lowered.append(a) or real(*a))
    second, fenced = run_alone(store)
    assert EXECUTABLES.loaded == loaded + 1
    if fenced:  # (keyed by its jaxpr: the program that runs was never lowered)
        assert lowered == []
    assert_trees_equal(first, want)
    assert_trees_equal(second, want)


_IDENTITY = """
import jax, jax.numpy as jnp
from xshare.runtime.compiled.program import jaxpr_identity
for scale in (1.0, 2.0):
    c = jnp.arange(3.0) * scale
    print(jaxpr_identity(jax.make_jaxpr(lambda x: jnp.tanh(x + c).sum() * 0.5)(jnp.ones(3))))
"""


def test_a_jaxpr_key_is_the_same_in_another_process_and_differs_with_a_constants_value():
    def identities() -> list[str]:
        out = subprocess.run([sys.executable, "-c", _IDENTITY], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()

    one, other = identities(), identities()
    assert len(one) == 2
    assert one == other and "None" not in one  # a kept program is found again by a new process
    assert one[0] != one[1]  # the constant's bytes are in the key, not only its shape


def test_a_step_that_calls_back_into_python_is_keyed_by_its_lowering():
    def step(x):
        return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((), jnp.float32), x)

    assert jaxpr_identity(jax.make_jaxpr(step)(1.0)) is None


@pytest.mark.parametrize("steps_per_call", [1, None])
def test_jobs_step_alone_on_their_kept_program_while_their_group_compiles_then_move_in(
        store, monkeypatch, steps_per_call):
    """A fused runtime whose jobs' own program is kept whole (an unfused run kept it) but whose
    group program is not compiled: the jobs do not wait for that compile. They step alone on
    their program, move into the group at a step boundary once it is compiled, and end where
    the jit loop does (one to sixteen steps per call)."""
    from xshare.runtime import prepare
    from xshare.runtime.compiled.payoff import FUSION, FusionVerdicts
    # No fusion verdict for this program (the session's file may hold one): its group opens.
    monkeypatch.setattr(FUSION, "_table", FusionVerdicts()._table)
    monkeypatch.setattr(FUSION, "persist", lambda directory: None)
    # A core to spare for the group's compile (a 2-core CPU machine has none: prepare.py)
    monkeypatch.setattr(prepare, "cores_to_spare", lambda platform: 1)
    from tests.helpers import plain_loop
    kw = {} if steps_per_call is None else {"steps_per_call": steps_per_call}
    PROGRAMS.clear()
    with xshare.Runtime(memory="256MiB", compilation_cache=str(store), **kw) as rt:
        rt.submit_many(specs())
        rt.wait()
    settle()
    assert kept(store)  # the jobs' own program (and a K-step one, where it was kept)
    PROGRAMS.clear()  # as in a new process: no program in memory
    fusion._cache.clear()
    built, stepped = threading.Event(), threading.Event()
    compile_group = fusion.fused_program

    def fused_program(*args, **kwargs):
        # The group's compile starts once a job has stepped alone (a fast compile, as jax 0.12's
        # is here, could otherwise finish before any job's first step: nothing would be seen alone)
        assert stepped.wait(60)
        out = compile_group(*args, **kwargs)
        built.set()
        return out

    monkeypatch.setattr(fusion, "fused_program", fused_program)

    def gated(seed):
        data = linreg_data(seed=seed)

        def batch(k):
            if k == 5:
                stepped.set()
            if k == 10:  # (no job steps past here before the group is compiled)
                assert built.wait(60)
            return data(k)
        return batch

    jobs = [linreg_step.bind(linreg_state(seed=i), gated(i), steps=STEPS, name=f"k{i}") for i in range(3)]
    # (fuse=True: fuse="always" runs every step fused, so its jobs wait for their group)
    with xshare.Runtime(memory="256MiB", fuse=True, compilation_cache=str(store), **kw) as rt:
        handles = rt.submit_many(jobs)
        rt.wait()
        fused = rt.snapshot()["runtime"]["fused_member_steps"]
    assert built.is_set()
    assert [h.status() for h in handles] == ["done"] * 3
    assert 5 <= 3 * STEPS - fused and fused > 0  # their first steps alone, later ones fused
    for h, i in zip(handles, range(3)):
        assert_trees_equal(h.result()[0], plain_loop(linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i),
                                                                      steps=STEPS))[0])


def test_a_compile_beside_stepping_jobs_needs_a_core_neither_the_dispatcher_nor_a_cpu_device_holds(monkeypatch):
    from xshare.runtime import prepare
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {0, 1})
    assert prepare.cores_to_spare("cpu") == 0 and prepare.cores_to_spare("gpu") == 1
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert prepare.cores_to_spare("cpu") == 14
