"""Programs kept whole beside the persistent compilation cache: one-step, fused group and K-step
programs, and a group's slot moves.

A fused sweep's first step waits for its group program, and on a machine whose XLA cache
already holds that program the wait is not XLA's: it is the Python that traces and lowers the
vmapped step (~0.1 s for the hook's Flax TrainState on a 2-core CPU), needed only to compute
XLA's cache key. So the group program's executable (and a K-step program's, lowered on the
tiers' thread while jobs run; a job's one-step program, keyed by its jaxpr and lowered only to
compile: ``program.jaxpr_identity``) is also kept under xshare's own key (the program's key, the
capacity or form, the fences, the versions, the device, ``XLA_FLAGS``), in
``<compilation cache>/executables/``, and a later process loads it without lowering anything
(~2 ms).

Two guards, from what failed before (benchmarks/RESULTS.md, "One lowering, one trace per
process"):

* Only a fresh compile is kept. An executable that XLA itself loaded from its persistent cache
  serializes without its compiled functions on jaxlib's CPU backend (its first call raised
  ``NOT_FOUND: Function ... not found``). When XLA's cache answered, the program is compiled
  again on a thread of its own with a compile option at its default value, which only changes
  XLA's cache key, and that fresh copy is kept.
* A loaded executable runs once on zeros before it is used (in a scratch fence ring when the
  program is fenced); if that raises, the file is dropped and the program is lowered as usual.
  Only programs whose arguments fit in ``TRIAL_BYTES`` are kept: the trial allocates them, and
  for larger programs lowering is a small part of the start anyway.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from .program import tree_nbytes

log = logging.getLogger("xshare.runtime")

TRIAL_BYTES = 16 << 20
# A debug option at its default value: the same code, another key in XLA's persistent cache.
FRESH = {"xla_llvm_disable_expensive_passes": False}
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_FRESH_LOCK = threading.Lock()


class Executables:
    """The store (``persist(directory)`` turns it on; ``Runtime`` does, beside ``VERDICTS``)."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.loaded = self.saved = 0       # counts, for tests and status
        self._local = threading.local()
        # Executables XLA loaded from its cache, as jax's in-memory cache may hand the same one
        # out again later without an event (the trial call would catch it too: this saves the
        # fallback). Weak: they go with jax's cache.
        self._from_xla: weakref.WeakSet = weakref.WeakSet()
        self._listening = False
        self._lock = threading.Lock()

    def persist(self, directory: str | os.PathLike) -> None:
        with self._lock:
            self.directory = Path(directory) / "executables"
            if not self._listening:
                jax.monitoring.register_event_listener(self._on_event)
                self._listening = True

    def _on_event(self, event: str, *args: Any, **kwargs: Any) -> None:
        if event == _HIT_EVENT:
            self._local.hit = True  # (recorded on the thread that compiles)

    def key(self, *parts: Any, device: Any) -> str:
        import jaxlib

        text = repr((parts, jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                     os.environ.get("XLA_FLAGS", "")))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def compile_program(self, parts: tuple, lower: Callable[[], Any], args: list, *, fenced: bool,
                        device: Any) -> tuple[Any, float, bool]:
        """``compile`` for one of the runtime's programs, whose arguments are ``args``: (state,
        batch[, the fences' ident]) as ShapeDtypeStructs. Its key is ``parts`` with the fences
        (and the fence library's sources: its custom calls), its size that of state and batch,
        and its trial one call on zeros of them (in a scratch fence ring when fenced)."""
        def trial(compiled: Any) -> Any:
            return compiled(*zeros_like(args[:2]), *([_trial_ident(device)] if fenced else []))

        return self.compile(self.key(*parts, fenced, _ffi_sources(fenced), device=device), lower,
                            device=device, nbytes=tree_nbytes(args[:2]), trial=trial)

    def has_program(self, parts: tuple, args: list, *, fenced: bool, device: Any) -> bool:
        """Whether ``compile_program(parts, ...)`` would load a kept executable rather than
        compile (its file is there; the trial call still decides when it loads)."""
        return self.has(self.key(*parts, fenced, _ffi_sources(fenced), device=device), tree_nbytes(args[:2]))

    def has(self, key: str, nbytes: int) -> bool:
        """Whether ``compile(key, ...)`` of an executable of ``nbytes`` would load a kept one
        (its file is there; the trial call still decides when it loads)."""
        directory = self.directory if nbytes <= TRIAL_BYTES else None
        return directory is not None and (directory / f"{key}.xla").exists()

    def compile(self, key: str, lower: Callable[[], Any], *, device: Any, nbytes: int,
                trial: Callable[[Any], Any]) -> tuple[Any, float, bool]:
        """``(compiled, seconds, loaded)``: the kept executable for ``key`` if there is one and
        its trial call on zeros passes (seconds: its load and trial), else ``lower().compile()``
        (seconds: XLA's compile alone, not the lowering; kept when fresh)."""
        directory = self.directory if nbytes <= TRIAL_BYTES else None
        if directory is not None:
            t0 = time.perf_counter()
            got = self._load(directory / f"{key}.xla", device, trial)
            if got is not None:
                return got, time.perf_counter() - t0, True
        self._local.hit = False
        lowered = lower()
        t0 = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        inner = getattr(compiled, "_executable", None)  # (jax's object under the Compiled)
        if self._local.hit and inner is not None:
            self._from_xla.add(inner)
        if directory is not None:
            path = directory / f"{key}.xla"
            if not self._local.hit and (inner is None or inner not in self._from_xla):
                # Off the caller's path too: serializing and writing it took ~20 ms of a small
                # step's ~0.5 s start, and nothing this process runs waits for the file.
                threading.Thread(target=self._save, args=(path, compiled), name="xshare-keep-executable",
                                 daemon=False).start()  # (not a daemon: exit waits for the write)
            else:
                # Not serializable as XLA loaded it: a fresh copy, off the caller's path.
                threading.Thread(target=self._save_fresh, args=(path, lowered), name="xshare-keep-executable",
                                 daemon=False).start()  # (not a daemon: XLA aborts if exit finds it compiling)
        return compiled, seconds, False

    def _load(self, path: Path, device: Any, trial: Callable[[Any], Any]) -> Any | None:
        if not path.exists():
            return None
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 execution_devices=[device])
            jax.block_until_ready(trial(compiled))
        except Exception as err:  # noqa: BLE001 - any failure: drop it, lower as usual
            log.info("a kept executable did not load (%s: %s); compiling it again", type(err).__name__, err)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return compiled

    def _save(self, path: Path, compiled: Any) -> None:
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # whole or not at all: another process may be reading
        except Exception as err:  # noqa: BLE001 - keeping it is an optimization: never fail the run
            log.debug("could not keep an executable at %s: %s", path, err)
            return
        self.saved += 1

    def _save_fresh(self, path: Path, lowered: Any) -> None:
        # The fresh copy is not written to XLA's cache: if it were, the next fresh copy of this
        # program (its kept file lost, or dropped) would come from that cache too, unkeepable.
        # jax has no per-compile switch for it, so its write threshold is raised for this
        # compile (a compile on another thread meanwhile is not written either: it only costs
        # that program a compile in a later process).
        with _FRESH_LOCK:
            self._local.hit = False
            threshold = jax.config.jax_persistent_cache_min_compile_time_secs  # type: ignore[attr-defined]  # jax sets its options on Config at import (setattr)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
            try:
                compiled = lowered.compile(compiler_options=FRESH)
            except Exception as err:  # noqa: BLE001
                log.debug("could not compile a fresh copy to keep: %s", err)
                return
            finally:
                jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
            hit = self._local.hit
        if not hit:  # (else XLA's cache held a fresh-keyed copy from before: nothing to keep)
            self._save(path, compiled)


def zeros_like(structs: Any) -> Any:
    """Zeros for a trial call, shaped as ``structs`` (ShapeDtypeStructs, with shardings)."""
    return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), structs)


_trial_ring: int | None = None


def _trial_ident(device: Any) -> Any:
    """The fences' identity for trial calls: a ring of their own (never drained: its records
    are dropped once it is full, and no job's timeline reads it)."""
    global _trial_ring
    from ... import ffi

    if _trial_ring is None:
        _trial_ring = ffi.open_ring(1 << 8)
    return jax.device_put(ffi.ident(_trial_ring, 0, 0), device)


def _ffi_sources(fenced: bool) -> str:
    """What a fenced program calls into: the fence library's sources (its custom calls)."""
    if not fenced:
        return ""
    from ...ffi import _build
    return _build.source_hash()


EXECUTABLES = Executables()
