"""Controls as typed events: what a caller asks of a job, posted to the dispatcher thread.

``Runtime.pause/resume/cancel/set_priority`` (and the HTTP control routes through them) build
one of these frozen messages and wait for ``Dispatcher.control`` to apply it between two steps;
the dispatcher is the only writer of a job's run-time state. (``states.Event`` is something
else: the transitions of a job's state machine.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Pause:
    """Stop stepping ``job``; with ``offload``, move its state to host memory too."""

    job: Any
    offload: bool = False


@dataclass(frozen=True)
class Resume:
    """Step a paused job again (back from the host first, if it was offloaded)."""

    job: Any


@dataclass(frozen=True)
class Cancel:
    """End ``job`` after its steps in flight; its memory goes to whoever waits."""

    job: Any


@dataclass(frozen=True)
class SetPriority:
    """``job``'s new priority (the policy sees it at the next plan)."""

    job: Any
    priority: int


Control = Union[Pause, Resume, Cancel, SetPriority]
