"""A job's lifecycle as one state and a transition table: pure, no jax, no clocks.

Every change of a job's state goes through :func:`transition`, which raises on a move the
table does not allow. The runtime's dispatcher is the only writer; everything else (handles,
status, ``xshare top``) reads the state. One enum instead of flags means a new feature (fused
groups, a service, many devices) reasons about eight states, not about flag combinations.

    COMPILING --ADMIT--> RUNNING --PAUSE--> PAUSED --OFFLOAD--> SWAPPED
        |  \\--QUEUE--> QUEUED --ADMIT--/  ^--RESUME--/            |
        |                  \\--PAUSE--> SWAPPED <-------------------/
        +-- FINISH / FAIL / CANCEL from any live state --> DONE / FAILED / CANCELLED

SWAPPED means "paused and holding no device memory": its state is on the host (offloaded), or
it was paused before it was ever placed. Resuming it asks for memory again (ADMIT or QUEUE),
or waits for its compile (AWAIT_COMPILE) if that has not finished.
"""

from __future__ import annotations

import enum

from ..._errors import XShareError


class JobState(str, enum.Enum):
    COMPILING = "compiling"  # tracing/compiling on the compile pool (or a shared program's)
    QUEUED = "queued"        # compiled; waiting for arena memory
    RUNNING = "running"      # resident on the device; the scheduler may step it
    PAUSED = "paused"        # resident, not stepping
    SWAPPED = "swapped"      # paused, holding no device memory (state on the host or unplaced)
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def public(self) -> str:
        """The status users see (``JobHandle.status()``): a swapped job is a paused job."""
        return "paused" if self is JobState.SWAPPED else self.value


class Event(str, enum.Enum):
    QUEUE = "queue"                  # compiled (or resumed) and no memory for it now
    ADMIT = "admit"                  # memory reserved and its state placed on the device
    PAUSE = "pause"
    OFFLOAD = "offload"              # a paused job's state moved to host memory
    RESUME = "resume"
    AWAIT_COMPILE = "await_compile"  # resumed before its compile finished
    FINISH = "finish"                # its last step (or its empty data) ended
    FAIL = "fail"
    CANCEL = "cancel"


S, E = JobState, Event
TERMINAL = frozenset({S.DONE, S.FAILED, S.CANCELLED})
LIVE = frozenset(S) - TERMINAL

_TABLE: dict[tuple[JobState, Event], JobState] = {
    (S.COMPILING, E.QUEUE): S.QUEUED,
    (S.COMPILING, E.ADMIT): S.RUNNING,
    (S.COMPILING, E.PAUSE): S.SWAPPED,
    (S.COMPILING, E.FINISH): S.DONE,      # no batches at all, or resumed already finished
    (S.QUEUED, E.ADMIT): S.RUNNING,
    (S.QUEUED, E.PAUSE): S.SWAPPED,       # leaves the queue; resume queues it again
    (S.RUNNING, E.PAUSE): S.PAUSED,
    (S.RUNNING, E.RESUME): S.RUNNING,     # resuming a running job changes nothing
    (S.RUNNING, E.FINISH): S.DONE,
    (S.PAUSED, E.PAUSE): S.PAUSED,
    (S.PAUSED, E.OFFLOAD): S.SWAPPED,
    (S.PAUSED, E.RESUME): S.RUNNING,
    (S.PAUSED, E.FINISH): S.DONE,         # paused after its last step was dispatched
    (S.SWAPPED, E.PAUSE): S.SWAPPED,
    (S.SWAPPED, E.OFFLOAD): S.SWAPPED,
    (S.SWAPPED, E.ADMIT): S.RUNNING,
    (S.SWAPPED, E.QUEUE): S.QUEUED,
    (S.SWAPPED, E.AWAIT_COMPILE): S.COMPILING,
}
# Failing and cancelling are allowed from every live state.
for _s in LIVE:
    _TABLE[(_s, E.FAIL)] = S.FAILED
    _TABLE[(_s, E.CANCEL)] = S.CANCELLED


class IllegalTransition(XShareError, RuntimeError):
    """A state change the lifecycle does not allow: a bug in the caller, never a user error."""


def transition(state: JobState, event: Event) -> JobState:
    """The state after ``event``; raises IllegalTransition naming both if it is not allowed."""
    try:
        return _TABLE[(state, event)]
    except KeyError:
        allowed = sorted(e.value for (s, e) in _TABLE if s is state)
        raise IllegalTransition(
            f"a {state.value} job cannot take event {event.value!r}; "
            f"allowed: {', '.join(allowed) or 'none (terminal)'}") from None


def allowed(state: JobState, event: Event) -> bool:
    return (state, event) in _TABLE
