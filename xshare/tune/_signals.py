"""SIGTERM as Ctrl-C while a study runs: what both drivers (``_driver.py``'s and Ray's,
``_ray.py``) guard their loop with."""

from __future__ import annotations

import signal
import threading


class _sigterm_as_interrupt:
    """SIGTERM raises KeyboardInterrupt while optimize runs (main thread only), so both end
    the study the same way; the previous handlers come back afterwards.

    A KeyboardInterrupt raised by a signal handler lands in whatever Python code the main thread
    runs at that moment, and CPython drops it (\"Exception ignored in ...\") when that is a garbage
    collector callback (jax registers one), a ``__del__`` or a weakref callback: the signal is
    then lost, and the study runs to its end. So the handler also records the signal, and the
    driver raises it again at its next turn (``check``, within a poll of 20 ms). SIGINT gets the
    same handler while Python's default one is installed (a handler of the caller's is left alone)."""

    def __init__(self):
        self.previous: dict = {}
        self.pending = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                self.pending = True
                raise KeyboardInterrupt
            self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
        return self

    def check(self) -> None:
        """Raise the KeyboardInterrupt of a signal that was received but never delivered."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous.clear()
        return False
