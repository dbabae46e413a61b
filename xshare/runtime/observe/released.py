"""A done job's final state released from memory once its final checkpoint is on disk.

A runtime keeps every done job's final state for ``result()``, by default. A runtime that never
ends (``xshare serve``) would then hold one final state per job it ever ran: 12.5 MiB a job for
a 1024-wide MLP with Adam, 12.7 MiB of RSS each (benchmarks/memory_per_job.py). With
``Runtime(keep_results=False)`` the recorder drops the state once it has written the job's final
checkpoint, and keeps only its structure (each array a zero-stride view of its dtype and shape);
``result()`` then reads the state back from that checkpoint. A final checkpoint that could not
be written releases nothing: the state stays in memory, and no work is lost.

Ordering: ``release`` sets ``job.on_disk`` before it clears ``job.host_state``, so a reader that
sees no state in memory finds where it went (``JobHandle.result`` reads them in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import XShareError


@dataclass(frozen=True)
class OnDisk:
    """Where a released final state is: the job's Orbax directory and its final step."""

    path: Path
    step: int
    like: tuple  # the state's (treedef, leaves), arrays as zero-stride views (``structure``)

    def load(self, job: str) -> Any:
        """The final state, read back from the checkpoint of ``step``.

        Raises:
          XShareError: that checkpoint is gone or is not the job's final one.
        """
        import jax

        from . import checkpoint

        where = (f"job {job!r} ran with Runtime(keep_results=False), so its final state is kept only "
                 f"in its final checkpoint (step {self.step}) under {self.path}")
        try:
            saved = checkpoint.load(self.path, jax.tree.unflatten(*self.like), job=job)
        except XShareError as err:
            raise XShareError(f"{where}, which could not be read: {err}") from err
        if saved is None or not saved.done or saved.step != self.step:
            found = "none" if saved is None else f"step {saved.step}{'' if saved.done else ', not done'}"
            raise XShareError(f"{where}; the newest checkpoint there is {found}. It was deleted or "
                              "replaced after the job ended; keep_results=True keeps final states in memory")
        return saved.state


@dataclass(frozen=True)
class NotKept:
    """A final state its runtime's owner let go of (``JobHandle._release_result``): ``result()``
    says why instead of returning it."""

    why: str

    def load(self, job: str) -> Any:
        raise XShareError(f"job {job!r}: {self.why}")


def structure(state: Any) -> tuple:
    """``state``'s structure, what ``checkpoint.load`` needs of it (``like``), in a few bytes a
    leaf: its treedef and its leaves, each numpy array replaced by a read-only zero-stride view
    of its dtype and shape. Kept flat: a tree rebuilt now would hold new nodes (an NNX state's
    Variables, ~25 KiB a zoo MLP job) until ``load``."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(state)
    return treedef, [np.broadcast_to(np.zeros((), x.dtype), x.shape) if isinstance(x, np.ndarray) else x
                     for x in leaves]


def on_disk(path: Path, step: int, state: Any) -> OnDisk:
    """Where ``state``, the final state of ``step`` written at ``path``, is kept."""
    return OnDisk(Path(path), step, structure(state))


def release(job: Any, step: int, path: Path, state: Any) -> None:
    """``job``'s final ``state`` of ``step`` is written at ``path``: keep only where it is."""
    job.on_disk = on_disk(path, step, state)
    job.host_state = None


_LIBC: Any = None  # glibc's malloc_trim, or False where there is none


def trim() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere).

    glibc keeps large freed blocks for reuse: a runtime that released a 12.5 MiB state per job
    still grew ~1 MiB of RSS a job with nothing held (benchmarks/memory_per_job.py). Trimmed
    after releases, it stayed flat. Dask's workers do the same for the same reason. It takes
    ~0.5 ms with a ~700 MiB heap."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import sys

        try:  # (glibc only: musl and other systems have no malloc_trim)
            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)
