"""Which compilation cache a benchmark's child process runs on.

The runtime keeps XLA's programs, their K-step forms and fused groups' forms, and what it
measured of them (verdicts, run history), in ``$XSHARE_COMPILATION_CACHE`` or
``~/.cache/xshare/xla``. An empty ``XSHARE_COMPILATION_CACHE`` is not "no cache": like an unset
one it means that default directory, which holds whatever earlier runs on the machine left. So a
child that must pay its own compiles gets a directory of its own instead.

``fresh``: a new, empty directory per child, removed afterwards: a machine that ran nothing
before (every compile paid, no verdict known), as the plain loop it is compared with, which keeps
no cache. ``machine``: the machine's own cache: a relaunch on a machine that ran the workload
before (the runtime's persistent cache is on by default, so this is what a returning user sees).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

CHOICES = ("fresh", "machine")


@contextmanager
def empty_cache(name: str = "xla") -> Iterator[str]:
    """A new, empty compilation cache directory, removed afterwards (for one child, or for a
    sequence of children that share it: ``first_runs.py``'s rounds)."""
    directory = tempfile.mkdtemp(prefix=f"xshare-bench-{name}-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def child_env(cache: str, **extra: str) -> Iterator[dict[str, str]]:
    """The environment for one child process on ``cache`` (``CHOICES``), with ``extra`` set."""
    if cache not in CHOICES:
        raise ValueError(f"cache={cache!r} must be one of {CHOICES}")
    env = {**os.environ, **extra}
    if cache == "machine":
        yield env
        return
    with empty_cache() as directory:
        yield {**env, "XSHARE_COMPILATION_CACHE": directory}
