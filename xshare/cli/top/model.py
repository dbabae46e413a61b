"""The live view's state and what keys do to it: the selected job, the sort key, the job
order, pausing the selected job, and the key reader (a terminal in cbreak mode)."""

from __future__ import annotations

import os
import queue
import select
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .fetch import View, control

SORT_KEYS = ("id", "name", "status", "lane", "steps/s", "share")
_ENDED = ("done", "failed", "cancelled")


@dataclass
class UI:
    """The live view's state: the selected job, the sort key, the last message."""

    selected: tuple[str, str] | None = None   # (runtime address, job name)
    sort: str = "id"
    message: str = ""
    live: bool = False


def ordered_jobs(status: dict[str, Any], sort: str) -> list[dict[str, Any]]:
    jobs = list(status.get("jobs", []))
    order = {"queued": 0, "running": 1, "paused": 2, "failed": 3, "cancelled": 4, "done": 5}
    keys: dict[str, Callable[[dict], Any]] = {
        "id": lambda j: j["id"],
        "name": lambda j: j["name"],
        "status": lambda j: (order.get(j["status"], 9), j["id"]),
        "lane": lambda j: (j["lane"] is None, j["lane"] or 0, j["id"]),
        "steps/s": lambda j: (-(j["steps_per_s"] or 0.0), j["id"]),
        "share": lambda j: (-(j["device_time_share"] or 0.0), j["id"]),
    }
    return sorted(jobs, key=keys.get(sort, keys["id"]))


def selectable(views: list[View], sort: str) -> list[tuple[str, str]]:
    return [(v.target.address, j["name"]) for v in views if v.status for j in ordered_jobs(v.status, sort)]


def apply_key(ui: UI, key: str, views: list[View]) -> bool:
    """Update ``ui`` for ``key``; True when the views should be fetched again at once."""
    order = selectable(views, ui.sort)
    if key in ("up", "down") and order:
        i = order.index(ui.selected) if ui.selected in order else 0
        ui.selected = order[(i + (1 if key == "down" else -1)) % len(order)]
    elif key == "s":
        ui.sort = SORT_KEYS[(SORT_KEYS.index(ui.sort) + 1) % len(SORT_KEYS)]
    elif key == "p" and ui.selected is not None:
        ui.message = toggle_pause(views, ui.selected)
        return True  # show the effect at once
    return False


def toggle_pause(views: list[View], selected: tuple[str, str]) -> str:
    address, name = selected
    for v in views:
        if v.target.address != address or v.status is None:
            continue
        job = next((j for j in v.status["jobs"] if j["name"] == name), None)
        if job is None:
            return f"{name}: gone"
        if job["status"] in _ENDED:
            return f"{name} is {job['status']}; nothing to pause"
        if not v.target.token:
            return (f"no token for {address}: pass --token, or run xshare top as the user who "
                    "started the runtime (its discovery file holds the token)")
        action = "resume" if job["paused"] or job["status"] == "paused" else "pause"
        try:
            control(v.target, name, action)
        except RuntimeError as err:
            return f"{action} {name}: {err}"
        return f"{action}d {name}"
    return f"{address}: not reachable"


class KeyReader:
    """Reads keys from a terminal in cbreak mode on a daemon thread: ``get(timeout)`` returns
    "q", "p", "s", "up", "down" (and other single characters), or None on timeout. Restores
    the terminal on exit. Without a terminal on stdin it reads nothing (Ctrl-C still quits)."""

    _SEQUENCES = {b"\x1b[A": "up", b"\x1bOA": "up", b"\x1b[B": "down", b"\x1bOB": "down"}

    def __init__(self, stream: Any = None):
        self._stream = stream if stream is not None else sys.stdin
        self._keys: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._saved: Any = None
        self._thread: threading.Thread | None = None
        self._fd: int | None = None

    def __enter__(self) -> "KeyReader":
        try:
            fd = self._stream.fileno()
            isatty = os.isatty(fd)
        except (AttributeError, OSError, ValueError):
            return self
        if not isatty:
            return self
        import termios
        import tty

        self._fd = fd
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)  # keys arrive one at a time, unechoed; Ctrl-C still interrupts
        self._thread = threading.Thread(target=self._read, name="xshare-top-keys", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._saved is not None and self._fd is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def get(self, timeout: float) -> str | None:
        try:
            return self._keys.get(timeout=max(timeout, 0))
        except queue.Empty:
            return None

    def _read(self) -> None:
        fd = self._fd
        assert fd is not None  # (the thread starts once __enter__ has set it)
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(fd, 64)
            except (OSError, ValueError):
                return
            if not data:
                return
            for key in self.parse(data):
                self._keys.put(key)

    @classmethod
    def parse(cls, data: bytes) -> list[str]:
        keys, i = [], 0
        while i < len(data):
            for seq, name in cls._SEQUENCES.items():
                if data.startswith(seq, i):
                    keys.append(name)
                    i += len(seq)
                    break
            else:
                if data[i] == 0x1B:  # another escape sequence: skip it whole
                    i += 1
                    while i < len(data) and not (0x40 <= data[i] <= 0x7E and data[i] not in b"[O"):
                        i += 1
                    i += 1
                    continue
                keys.append({"k": "up", "j": "down"}.get(chr(data[i]), chr(data[i]).lower()))
                i += 1
        return keys
