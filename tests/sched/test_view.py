"""The snapshot types: frozen, copied, comparable; misuse raises with the bad value named."""

from __future__ import annotations

import dataclasses
import re

import pytest

from xshare.sched import Decision, JobView, View


def job(id: int, lane: int = 0) -> JobView:
    return JobView(id=id, name=f"j{id}", arrival=0.0, priority=0, steps_done=0, steps_left=None,
                   step_time_s=1.0, device_time_s=0.0, lane=lane, last_seq=-1, turn_steps=0)


def test_decision_is_read_only_and_copied():
    """The runtime reads a decision from several lane threads: nobody may mutate it."""
    source = {0: 1}
    decision = Decision(source)
    source[1] = 2
    assert dict(decision.run) == {0: 1}
    with pytest.raises(TypeError):
        decision.run[0] = 5  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.run = {}  # type: ignore[misc]


def test_decision_equality_and_hash():
    """Equal mappings are equal decisions (tests and determinism checks compare them)."""
    assert Decision({0: 1, 1: 2}) == Decision({1: 2, 0: 1})
    assert hash(Decision({0: 1, 1: 2})) == hash(Decision({1: 2, 0: 1}))
    assert Decision({0: 1}) != Decision({0: 2})
    assert repr(Decision({1: 2, 0: 1})) == "Decision(run={0: 1, 1: 2})"


def test_decision_helpers():
    """``of`` runs each job in its own lane; ``idle`` runs nothing."""
    assert dict(Decision.of([job(7, lane=2), job(3, lane=0)]).run) == {2: 7, 0: 3}
    assert dict(Decision.idle().run) == {}
    assert Decision.idle() == Decision()


def test_view_is_frozen_and_stores_tuples():
    view = View(now=1.0, jobs=[job(1)], lanes=[0])  # type: ignore[arg-type]
    assert view.jobs == (job(1),) and view.lanes == (0,) and view.quantum == 1
    hash(view)  # hashable: usable as a memo key
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.now = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("quantum", [0, -1, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_view_rejects_bad_quantum(quantum):
    """A quantum below 1 would stop round-robin rotating; it is misuse, so it raises."""
    with pytest.raises(ValueError, match=re.escape(f"quantum must be an int >= 1, got {quantum!r}")):
        View(now=0.0, jobs=(), lanes=(), quantum=quantum)
