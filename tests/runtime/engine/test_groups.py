"""Fusion groups' lifecycle on hand-made jobs and the real (pure) arena: open, join, grow,
adopt, leave, close; the device side is a fake that keeps slots as Python lists."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from xshare.memory import Footprint
from xshare.runtime.engine.group import Group
from xshare.runtime.engine.groups import Groups
from xshare.runtime.engine.states import JobState

from . import fakes
from .engine import MIB, Parts

S = JobState


@dataclass(frozen=True)
class Program:
    key: str
    convolves: bool = False


@dataclass(frozen=True)
class Fused:
    capacity: int
    footprint: Footprint
    compile_s: float = 1.0
    flops: float | None = None


class Device:
    """Group programs cost 1 MiB per slot; a group's "stack" is a list of per-slot leaves."""

    def __init__(self, platform: str = "cpu") -> None:
        self.compiled: list[tuple[str, int]] = []
        self.platform = platform

    def program(self, program: Program, capacity: int) -> Fused:
        self.compiled.append((program.key, capacity))
        return Fused(capacity, Footprint(persistent=capacity * MIB // 2, ephemeral=capacity * MIB // 2))

    def cached(self, program: Program, capacity: int) -> bool:
        return (program.key, capacity) in self.compiled

    def open(self, gid: int, program: Program, fused: Fused, lane: int, name: str) -> Group:
        return Group(gid, program, fused, lane, [None] * fused.capacity, None, [np.zeros(4, np.float32)], name=name)

    def put(self, group: Group, leaves: list, slot: int) -> None:
        group.arrays[slot] = list(leaves)

    def regroup(self, group: Group, slots: list[int], fused: Fused) -> None:
        kept = [group.arrays[i] for i in slots]
        group.arrays = kept + [None] * (fused.capacity - len(kept))


class Layout:
    n_arrays = 1

    def split(self, state: Any) -> list:
        return list(state)


def fused_job(name: str, key: str = "mlp", *, hint: int = 1, mib: int = 1, steps: int | None = 10,
              convolves: bool = False) -> Any:
    j = fakes.job(name, mib=mib, steps=steps)
    j.program, j.fuse_hint, j.layout = Program(key, convolves), hint, Layout()
    j.spec = j.spec.replace(state=[f"{name}-state"])
    return j


def grouped(capacity_mib: float = 64, floor: int | None = None, platform: str = "cpu",
            streams: int = 1) -> tuple[Parts, Groups, Device]:
    parts, device = Parts(capacity_mib), Device(platform)
    drains = []
    groups = Groups(parts.units, parts.arena, parts.admission, parts.recorder, device, floor=floor,
                    ids=itertools.count(1000), timeline=fakes.Timeline(), drain=lambda: drains.append(1),
                    streams=streams)
    groups.abort = parts.life.abort
    parts.admission.join = groups.join
    parts.life.forgetters = (parts.admission.forget, groups.forget)
    return parts, groups, device


def stepping_alone(parts: Parts, names: str) -> list:
    """Jobs of the program running alone and adoptable, as a dissolved group leaves its members."""
    jobs = [fused_job(n) for n in names]
    for j in jobs:
        j.unfused = "stepping alone"  # (submitted so, they open no group)
    parts.submit(*jobs)
    for j in jobs:
        j.unfused = None
    return jobs


def test_jobs_submitted_together_open_one_group_with_room_for_all_and_one_reservation():
    parts, groups, device = grouped()
    a, b, c = (fused_job(n, hint=3) for n in "abc")
    parts.submit(a, b, c)
    (g,) = groups.all()
    assert g.capacity == 4 and g.members == [a, b, c] and [j.slot for j in (a, b, c)] == [0, 1, 2]
    assert g.arrays[:3] == [["a-state"], ["b-state"], ["c-state"]]
    assert all(j.state is S.RUNNING and not j.in_ledger for j in (a, b, c))
    assert parts.ledger() == {g.id} and set(parts.units.running) == {g.id}  # the group is the unit
    assert device.compiled == [("mlp", 4)]
    assert "joined group-0 (slot 0 of 4" in parts.recorder.said("a")[0]


def test_a_convolving_program_nothing_measured_opens_no_group_on_a_cpu_and_is_measured_elsewhere():
    # On a CPU its vmapped convolutions would be grouped ones, which XLA:CPU runs at about the
    # members' count times each member's cost (payoff.unmeasured): its jobs run alone. On
    # another platform the group opens, to be measured.
    parts, groups, device = grouped()
    jobs = [fused_job(n, "cnn", hint=3, convolves=True) for n in "abc"]
    parts.submit(*jobs)
    assert groups.all() == [] and device.compiled == [] and all(j.state is S.RUNNING for j in jobs)
    parts, groups, device = grouped(platform="gpu")
    parts.submit(*[fused_job(n, "cnn", hint=3, convolves=True) for n in "abc"])
    assert len(groups.all()) == 1 and device.compiled == [("cnn", 4)]


def test_there_is_no_group_of_one_a_lone_job_runs_alone():
    parts, groups, _ = grouped()
    a = fused_job("a")
    parts.submit(a)
    assert groups.all() == [] and a.group is None and a.in_ledger and a.state is S.RUNNING


def test_a_later_job_adopts_a_running_job_of_its_program_and_its_own_reservation_goes():
    parts, groups, _ = grouped()
    a = fused_job("a")
    parts.submit(a)
    b = fused_job("b")
    parts.submit(b)
    (g,) = groups.all()
    assert g.members == [a, b] and a.group is g and not a.in_ledger and parts.ledger() == {g.id}
    assert a.arrays is None and g.arrays[0] == ["a-state"]  # its newest state moved into the stack
    assert "moved into group-0" in parts.recorder.said("a")[-1]


def test_a_joiner_that_adopts_more_running_jobs_than_its_group_holds_keeps_its_slot_the_rest_open_another():
    # The zoo's arrivals: a group dissolved (fusing lost at its capacity), its six jobs step
    # alone, and a seventh job of the program arrives. On two streams 7 jobs open groups of 4:
    # adopting all it could, the first filled its 4 slots with running jobs, the joiner had no
    # slot (an AssertionError in an event nobody read), and neither it nor the group stepped.
    parts, groups, device = grouped(streams=2)
    solos = stepping_alone(parts, "abcdef")
    assert groups.all() == [] and all(j.in_ledger for j in solos)
    g = fused_job("g")
    parts.submit(g)
    first, second = groups.all()
    assert first.capacity == second.capacity == 4 and device.compiled == [("mlp", 4), ("mlp", 4)]
    assert g in first.members and len(first.members) == 4 and len(second.members) == 3
    assert sorted(j.name for j in first.members + second.members) == list("abcdefg")
    assert g.state is S.RUNNING and set(parts.units.running) == {first.id, second.id}
    assert parts.ledger() == {first.id, second.id}  # the movers' own reservations went


def test_running_jobs_moving_in_are_shared_out_evenly_and_a_share_of_one_stays_alone():
    from xshare.runtime.engine.groups import GROUP_COMPILING
    parts, groups, _ = grouped(streams=2)
    jobs = [fused_job(n, hint=5) for n in "abcde"]
    for j in jobs:
        j.unfused = GROUP_COMPILING
    parts.submit(*jobs)
    groups.gather(Program("mlp"), jobs, compiled=True)
    assert sorted(len(g.members) for g in groups.all()) == [2, 3]  # not 4 and a group of one
    parts, groups, _ = grouped(streams=2)
    stepping_alone(parts, "abcd")
    e = fused_job("e")
    parts.submit(e)  # 5 joining on 2 streams: groups of 4, shared 3 and 2
    assert sorted(len(g.members) for g in groups.all()) == [2, 3] and e.group is not None


def test_a_full_group_doubles_for_a_joiner_and_keeps_its_members_states():
    parts, groups, device = grouped()
    a, b = fused_job("a", hint=2), fused_job("b", hint=2)
    parts.submit(a, b)
    c = fused_job("c")
    parts.submit(c)
    (g,) = groups.all()
    assert g.capacity == 4 and g.members == [a, b, c]
    assert g.arrays[:3] == [["a-state"], ["b-state"], ["c-state"]]
    assert device.compiled == [("mlp", 2), ("mlp", 4)]


def test_a_group_that_does_not_fit_leaves_its_jobs_to_run_or_queue_alone():
    parts, groups, _ = grouped(capacity_mib=3)  # a 4-slot group needs 4 MiB
    a, b, c = (fused_job(n, hint=3) for n in "abc")
    parts.submit(a, b, c)
    assert groups.all() == [] and a.state is S.RUNNING and a.group is None and b.state is S.RUNNING
    assert parts.ledger() == {a.id, b.id, c.id}  # each holds (or queues for) its own bytes


def test_members_leaving_shrink_the_group_and_the_last_one_closes_it_and_frees_its_lane():
    parts, groups, device = grouped(capacity_mib=13)
    jobs = [fused_job(f"j{i}", hint=8, steps=None) for i in range(8)]  # (steps enough to repay a compile)
    parts.submit(*jobs)
    (g,) = groups.all()
    waiting = fused_job("big", key="cnn", mib=6)  # 9 MiB; the 8-slot group holds 8 of 13
    parts.submit(waiting)
    assert waiting.state is S.QUEUED
    for j in jobs[2:]:
        parts.life.end(j, _cancel())
    # 2 members left of 8 (a quarter): repacked into 2 slots; their steps repay that compile
    assert g.capacity == 2 and g.members == jobs[:2] and [j.slot for j in jobs[:2]] == [0, 1]
    assert waiting.state is S.RUNNING  # the bytes the group gave back admitted the queued job
    for j in jobs[:2]:
        parts.life.end(j, _cancel())
    assert groups.all() == [] and g.id not in parts.ledger() and g.id not in parts.units.running


def test_a_floor_keeps_groups_at_least_that_large_and_opens_one_for_a_shared_program():
    parts, groups, _ = grouped(floor=4)
    a = fused_job("a")
    a.shared = True  # other jobs of its family run its program (a study's trials)
    parts.submit(a)
    (g,) = groups.all()
    assert g.capacity == 4 and g.members == [a]
    b = fused_job("b")
    b.shared = True
    parts.submit(b)
    parts.life.end(b, _cancel())
    assert g.capacity == 4  # never below the floor


def test_a_joiner_whose_state_cannot_be_put_in_the_group_fails_alone():
    parts, groups, device = grouped()
    a, b, c = (fused_job(n, hint=3) for n in "abc")

    def put(group, leaves, slot):
        if leaves == ["b-state"]:
            raise RuntimeError("INTERNAL: dynamic_update_slice failed")
        group.arrays[slot] = list(leaves)

    device.put = put
    parts.submit(a, b, c)
    assert b.state is S.FAILED and b.error.startswith("could not place its state in group-0: RuntimeError")
    (g,) = groups.all()
    assert g.members == [a, c] and a.state is c.state is S.RUNNING
    # A newcomer that fails so after adopting running jobs into the group it opened: they step on.
    parts, groups, device = grouped()
    device.put = put
    (d,) = stepping_alone(parts, "d")
    b = fused_job("b")
    parts.submit(b)
    (g,) = groups.all()
    assert b.state is S.FAILED and g.members == [d] and set(parts.units.running) == {g.id}


def _cancel():
    from xshare.runtime.engine.states import Event
    return Event.CANCEL


def test_a_group_ending_in_lockstep_does_not_compile_a_smaller_program_it_could_not_repay():
    parts, groups, device = grouped()
    jobs = [fused_job(f"j{i}", hint=8, steps=10) for i in range(8)]  # 10 steps left: 10 ms of saving
    parts.submit(*jobs)
    (g,) = groups.all()
    for j in jobs[2:]:
        parts.life.end(j, _cancel())
    assert g.capacity == 8 and device.compiled == [("mlp", 8)]


def test_jobs_that_stepped_alone_while_their_group_compiled_gather_into_it():
    """prepare.py posts jobs whose group program compiles as solo jobs (``GROUP_COMPILING``);
    once it is compiled, those still running move into one group with one reservation, and a
    job not admitted yet joins it as any job would."""
    from xshare.runtime.engine.groups import GROUP_COMPILING
    parts, groups, _ = grouped()
    a, b, c = (fused_job(n, hint=3) for n in "abc")
    for j in (a, b, c):
        j.unfused = GROUP_COMPILING
    parts.submit(a, b)  # (c: not admitted yet)
    assert groups.all() == [] and a.state is S.RUNNING and a.in_ledger  # alone meanwhile
    groups.gather(Program("mlp"), [a, b, c], compiled=True)
    (g,) = groups.all()
    assert g.members == [a, b] and g.capacity == 2 and not a.in_ledger and parts.ledger() == {g.id}
    assert all(j.unfused is None for j in (a, b, c))
    assert "moved into group-0" in parts.recorder.said("a")[-1]
    parts.submit(c)
    assert g.members == [a, b, c] and g.capacity == 4


def test_a_gathering_that_would_not_pay_or_whose_program_failed_leaves_them_alone(monkeypatch):
    from xshare.runtime.compiled.payoff import FUSION, FusionVerdict, FusionVerdicts
    from xshare.runtime.engine.groups import GROUP_COMPILING
    monkeypatch.setattr(FUSION, "_table", FusionVerdicts()._table)
    FUSION.put("mlp", FusionVerdict(capacity=2, solo_step_s=50e-6, fused_step_s=400e-6))  # loses
    parts, groups, _ = grouped()
    a, b = fused_job("a", hint=2), fused_job("b", hint=2)
    for j in (a, b):
        j.unfused = GROUP_COMPILING
    parts.submit(a, b)
    groups.gather(Program("mlp"), [a, b], compiled=True)
    assert groups.all() == [] and a.group is None and a.in_ledger
    assert a.unfused.startswith("fusing does not pay for this program")
    assert "stays alone: fusing does not pay" in parts.recorder.said("a")[-1]
    c, d = fused_job("c", "cnn", hint=2), fused_job("d", "cnn", hint=2)
    for j in (c, d):
        j.unfused = GROUP_COMPILING
    parts.submit(c, d)
    groups.gather(Program("cnn"), [c, d], compiled=False)
    assert groups.all() == [] and c.unfused == "its group's program did not compile"
