"""The job lifecycle table, exhaustively: every (state, event) pair is either in the table with
the target the lifecycle promises, or refused with a message naming both."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest

from xshare.runtime.engine.states import LIVE, TERMINAL, Event, IllegalTransition, JobState, allowed, transition

S, E = JobState, Event

# Every allowed move, and why it exists.
EXPECTED = {
    (S.COMPILING, E.QUEUE): S.QUEUED,      # compiled, no memory now
    (S.COMPILING, E.ADMIT): S.RUNNING,     # compiled and placed
    (S.COMPILING, E.PAUSE): S.SWAPPED,     # paused before it ever held memory
    (S.COMPILING, E.FINISH): S.DONE,       # no batches, or resumed already finished
    (S.QUEUED, E.ADMIT): S.RUNNING,        # memory freed up
    (S.QUEUED, E.PAUSE): S.SWAPPED,        # leaves the queue
    (S.RUNNING, E.PAUSE): S.PAUSED,
    (S.RUNNING, E.RESUME): S.RUNNING,      # no-op
    (S.RUNNING, E.FINISH): S.DONE,
    (S.PAUSED, E.PAUSE): S.PAUSED,         # idempotent
    (S.PAUSED, E.OFFLOAD): S.SWAPPED,      # state moved to host memory
    (S.PAUSED, E.RESUME): S.RUNNING,
    (S.PAUSED, E.FINISH): S.DONE,          # paused after its last step was dispatched
    (S.SWAPPED, E.PAUSE): S.SWAPPED,
    (S.SWAPPED, E.OFFLOAD): S.SWAPPED,
    (S.SWAPPED, E.ADMIT): S.RUNNING,       # resumed and placed again
    (S.SWAPPED, E.QUEUE): S.QUEUED,        # resumed, no memory yet
    (S.SWAPPED, E.AWAIT_COMPILE): S.COMPILING,  # resumed before its compile finished
}
for live in LIVE:
    EXPECTED[(live, E.FAIL)] = S.FAILED
    EXPECTED[(live, E.CANCEL)] = S.CANCELLED


@pytest.mark.parametrize("state,event", list(itertools.product(JobState, Event)))
def test_every_pair_is_allowed_exactly_as_the_lifecycle_says(state, event):
    if (state, event) in EXPECTED:
        assert allowed(state, event)
        assert transition(state, event) is EXPECTED[(state, event)]
    else:
        assert not allowed(state, event)
        with pytest.raises(IllegalTransition, match=re.escape(f"a {state.value} job cannot take event {event.value!r}")):
            transition(state, event)


def test_terminal_states_take_no_event_and_say_so():
    for state in TERMINAL:
        assert state.terminal
        with pytest.raises(IllegalTransition, match="allowed: none \\(terminal\\)"):
            transition(state, E.CANCEL)


def test_a_swapped_job_shows_as_paused_to_users():
    assert S.SWAPPED.public == "paused"
    assert {s.public for s in JobState} == {"compiling", "queued", "running", "paused", "done",
                                            "failed", "cancelled"}


def test_the_state_machine_imports_no_jax():
    code = "import sys, xshare.runtime.engine.states; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
