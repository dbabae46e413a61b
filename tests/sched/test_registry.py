"""Policies by name: the names users type on the command line and in specs."""

from __future__ import annotations

import re

import pytest

from xshare.sched import POLICIES, Decision, Policy, View, get_policy


def test_policy_names_in_order():
    assert POLICIES == ("fifo", "pack", "srtf", "fair", "priority")


@pytest.mark.parametrize(
    ("name", "exclusive"),
    [("fifo", True), ("pack", False), ("srtf", True), ("fair", False), ("priority", True)],
)
def test_get_policy_by_name(name, exclusive):
    """Each name gives a Policy with that name; exclusive tells the runtime to run one job at a time."""
    policy = get_policy(name)
    assert isinstance(policy, Policy)
    assert policy.name == name
    assert policy.exclusive is exclusive


@pytest.mark.parametrize("name", ["FIFO", "Pack", "sRtF", "FAIR", "Priority"])
def test_get_policy_is_case_insensitive(name):
    assert get_policy(name).name == name.lower()


def test_policy_instance_passes_through():
    """Users may bring their own policy object: it is returned as is, not copied or wrapped."""

    class Lifo:
        name = "lifo"
        exclusive = True

        def init(self):
            return 0

        def pick(self, view: View, state):
            jobs = [j for j in view.jobs if j.lane in view.lanes]
            return Decision.of([max(jobs, key=lambda j: (j.arrival, j.id))] if jobs else []), state

    mine = Lifo()
    assert get_policy(mine) is mine
    builtin = get_policy("pack")
    assert get_policy(builtin) is builtin


@pytest.mark.parametrize("name", ["lifo", "", "round-robin", "FIFO2"])
def test_unknown_name_lists_choices(name):
    with pytest.raises(ValueError, match=re.escape(
        f"unknown policy {name!r}; choose one of: fifo, pack, srtf, fair, priority"
    )):
        get_policy(name)


def test_unknown_name_exact_text():
    with pytest.raises(ValueError, match="^" + re.escape(
        "unknown policy 'lifo'; choose one of: fifo, pack, srtf, fair, priority") + "$"):
        get_policy("lifo")


def test_not_a_policy_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("got 42")):
        get_policy(42)  # type: ignore[arg-type]
