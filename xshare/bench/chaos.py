"""Random controls from another thread while a runtime's jobs run: pause, pause with offload,
resume, set_priority and cancel, as users clicking in ``xshare top`` would. The soak
(``benchmarks/soak.py``) and the random sweeps (``tests/reliability/test_random_sweeps.py``)
drive their runtimes with it. No jax.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

CONTROLS = ("pause", "offload", "resume", "priority", "cancel")


def random_controls(rt: Any, handles: Sequence[Any], rng: random.Random, *, weights: Sequence[float],
                    keep_going: Callable[[], bool], sleep_s: tuple[float, float] = (0.0, 0.01),
                    counts: dict[str, int] | None = None, cancelled: set[str] | None = None) -> None:
    """While ``keep_going()``: one control (drawn with ``weights``, one per ``CONTROLS``) on a
    random handle, then a pause of ``sleep_s`` (uniform). A control the runtime refuses (the job
    ended meanwhile: a fair race) counts as ``"refused"``. ``counts``: what was done, by name;
    ``cancelled``: the names of the jobs a cancel was accepted for. Every job is resumed at the
    end (a job left paused would never finish)."""
    from xshare import XShareError

    counts = {} if counts is None else counts
    while keep_going():
        handle = rng.choice(handles)
        what = rng.choices(CONTROLS, weights)[0]
        try:
            if what == "pause":
                rt.pause(handle)
            elif what == "offload":
                rt.pause(handle, offload=True)
            elif what == "resume":
                rt.resume(handle)
            elif what == "priority":
                rt.set_priority(handle, rng.randint(-5, 5))
            else:
                rt.cancel(handle)
                if cancelled is not None:
                    cancelled.add(handle.name)
            counts[what] = counts.get(what, 0) + 1
        except XShareError:
            counts["refused"] = counts.get("refused", 0) + 1
        time.sleep(rng.uniform(*sleep_s))
    for handle in handles:
        try:
            rt.resume(handle)
        except XShareError:
            pass
