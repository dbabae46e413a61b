"""A process-wide table of verdicts, kept beside the persistent compilation cache as JSON.

The K-step verdicts (``multistep.Verdicts``, ``verdicts-2.json``) and the fusion verdicts
(``payoff.FusionVerdicts``, ``fusion-verdicts.json``) are the same thing: a thread-safe table
keyed by tuples, read once from a directory (``persist``) and merged into the file on each
``put``. The file is a JSON list of rows (objects); what a row holds is its user's business
(``decode`` and ``encode``). A verdict only saves a measurement: a file that cannot be read is
ignored (one warning), one that cannot be written leaves the verdict in this process. No jax.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, TypeVar

log = logging.getLogger("xshare.runtime")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# What a row that is not what ``decode`` expects raises (a missing field, a string where a
# number goes, a row that is not an object), besides the file's own OSError / JSON ValueError.
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError)

# Measurements a verdict that may have been disturbed gets before it stands, in both tables: a
# bit-identical K-step form timed slower (``multistep.Verdict.recheck``), a narrow fusion loss
# (``payoff.FusionVerdict.recheck``). One timing on a shared machine can be off; three agreeing
# ones are not an accident.
RECHECKS = 3


class JsonTable(Generic[K, V]):
    """``key -> value`` in memory, behind one lock; with ``persist(directory)``, also the file
    ``directory/filename``.

    ``decode(row) -> (key, value)`` reads one row of the file; ``encode(key, value) -> row``
    writes one. Both are given by the table's user, so the file's format is theirs."""

    def __init__(self, filename: str, decode: Callable[[dict[str, Any]], tuple[K, V]],
                 encode: Callable[[K, V], dict[str, Any]]) -> None:
        self.filename = filename
        self._decode = decode
        self._encode = encode
        self._lock = threading.Lock()        # the table in memory
        self._file_lock = threading.Lock()   # one read-merge-write at a time in this process
        self._warn_lock = threading.Lock()
        self._by: dict[K, V] = {}
        self._path: Path | None = None
        self._warned: set[Path] = set()

    @property
    def path(self) -> Path | None:
        """The file this table reads and writes (None: in memory only)."""
        return self._path

    def persist(self, directory: str | os.PathLike[str] | None) -> None:
        """Read and from now on write the file in ``directory`` (None: in memory only). What is
        in memory already wins over the file's row for the same key; a second call with the
        same directory does nothing."""
        if directory is None:
            return
        path = Path(directory) / self.filename
        with self._lock:
            if self._path == path:
                return
            self._path = path
            for key, value in self._read(path).items():
                self._by.setdefault(key, value)

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._by.get(key)

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key``, and merge it into the file if there is one (read, add,
        write a temporary, rename: readers never see half a file; puts of this process are merged
        one at a time, while another process writing at the same time may lose one row, which
        only means that measurement is made again)."""
        with self._lock:
            self._by[key] = value
            path = self._path
        if path is not None:
            with self._file_lock:
                rows = self._read(path)
                rows[key] = value
                self._write(path, rows)

    def items(self) -> list[tuple[K, V]]:
        """A copy of the table's entries (safe to iterate while other threads put)."""
        with self._lock:
            return list(self._by.items())

    def values(self) -> list[V]:
        with self._lock:
            return list(self._by.values())

    def clear(self) -> None:
        """Forget what is in memory (the file is kept)."""
        with self._lock:
            self._by.clear()

    def _read(self, path: Path) -> dict[K, V]:
        try:
            return dict(self._decode(row) for row in json.loads(path.read_text()))
        except FileNotFoundError:
            return {}  # none yet
        except _UNREADABLE as e:
            with self._warn_lock:
                first = path not in self._warned
                self._warned.add(path)
            if first:
                log.warning("ignoring %s (unreadable: %s: %s); its verdicts are measured again",
                            path, type(e).__name__, e)
            return {}

    def _write(self, path: Path, rows: dict[K, V]) -> None:
        text = json.dumps([self._encode(k, v) for k, v in rows.items()])
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as e:
            log.debug("cannot write %s (%s): the verdicts stay in this process", path, e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
