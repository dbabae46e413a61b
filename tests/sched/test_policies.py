"""Table tests for each policy, one row per behaviour, each row saying why it exists.

Modelled on kube-scheduler's priority_sort_test.go: the table is the specification. Job
defaults are neutral (arrival = id, priority 0, 10 steps of 1 s, never run) so each row only
spells out the fields that matter to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from xshare.sched import Decision, JobView, View, get_policy


def job(id: int, **kw) -> JobView:
    fields = dict(
        id=id, name=f"j{id}", arrival=float(id), priority=0, steps_done=0, steps_left=10,
        step_time_s=1.0, device_time_s=0.0, lane=0, last_seq=-1, turn_steps=0,
    )
    fields.update(kw)
    return JobView(**fields)


@dataclass(frozen=True)
class Case:
    name: str
    why: str
    jobs: tuple[JobView, ...]
    want: dict[int, int]               # lane -> job id
    lanes: tuple[int, ...] | None = None  # default: every lane a job lives in
    quantum: int = 1

    def view(self) -> View:
        lanes = self.lanes if self.lanes is not None else tuple(sorted({j.lane for j in self.jobs}))
        return View(now=100.0, jobs=self.jobs, lanes=lanes, quantum=self.quantum)


def check(policy_name: str, case: Case) -> None:
    policy = get_policy(policy_name)
    state = policy.init()
    decision, new_state = policy.pick(case.view(), state)
    assert isinstance(decision, Decision)
    assert dict(decision.run) == case.want, case.why
    assert new_state == state


def ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


# Rows every policy must agree on: nothing to run means every lane idles.
EMPTY = [
    Case("empty view", "no jobs, no lanes: nothing runs", (), {}, lanes=()),
    Case("open lanes, no jobs", "open lanes without runnable jobs idle", (), {}, lanes=(0, 1)),
    Case("jobs, no open lane", "a job whose lane is not open can never be named", (job(1, lane=3),), {}, lanes=()),
]


@pytest.mark.parametrize("policy", ["fifo", "pack", "srtf", "fair", "priority"])
@pytest.mark.parametrize("case", EMPTY, ids=ids(EMPTY))
def test_empty_views(policy, case):
    check(policy, case)


FIFO = [
    Case("single job", "the only job runs, in its lane", (job(1, lane=2),), {2: 1}),
    Case("earliest arrival", "arrival, not id, orders jobs",
         (job(1, arrival=5.0), job(2, arrival=1.0)), {0: 2}),
    Case("arrival tie by id", "equal arrival: the smaller id (earlier submission) runs",
         (job(2, arrival=1.0), job(1, arrival=1.0)), {0: 1}),
    Case("exclusive across lanes", "one job device-wide, even with other lanes open",
         (job(1, lane=0, arrival=2.0), job(2, lane=1, arrival=1.0), job(3, lane=2)), {1: 2}),
    Case("ignores priority and length", "fifo is the baseline: a later urgent short job waits",
         (job(1, steps_left=1000), job(2, priority=9, steps_left=1)), {0: 1}),
    Case("not preempted", "a running job keeps the device; a later arrival waits, however urgent",
         (job(1, last_seq=40, turn_steps=40), job(2, arrival=50.0, priority=9, steps_left=1)), {0: 1}),
    Case("closed lane skipped", "the earliest job is in a closed lane; the next one runs",
         (job(1, lane=0), job(2, lane=1)), {1: 2}, lanes=(1,)),
]


@pytest.mark.parametrize("case", FIFO, ids=ids(FIFO))
def test_fifo(case):
    check("fifo", case)


PACK = [
    Case("one job per lane", "every lane with a runnable job runs one: lanes are filled",
         (job(1, lane=0), job(2, lane=1), job(3, lane=2)), {0: 1, 1: 2, 2: 3}),
    Case("idle lane", "an open lane without jobs is absent from the decision",
         (job(1, lane=0), job(2, lane=2)), {0: 1, 2: 2}, lanes=(0, 1, 2)),
    Case("lone job continues", "a job alone in its lane keeps running after its turn ends",
         (job(1, last_seq=5, turn_steps=1),), {0: 1}),
    Case("never-run goes next", "after a turn, a never-run job (last_seq -1) is the most starved",
         (job(1, last_seq=3, turn_steps=1), job(2)), {0: 2}),
    Case("never-run tie by arrival", "several never-run jobs start in arrival order",
         (job(1, arrival=2.0), job(2, arrival=1.0)), {0: 2}),
    Case("never-run tie by id", "same arrival: the smaller id starts first",
         (job(3, arrival=1.0), job(2, arrival=1.0)), {0: 2}),
    Case("turn not used up", "the current job continues while turn_steps < quantum",
         (job(1, last_seq=7, turn_steps=2), job(2, last_seq=4)), {0: 1}, quantum=3),
    Case("turn used up", "at turn_steps == quantum the lane rotates",
         (job(1, last_seq=7, turn_steps=3), job(2, last_seq=4)), {0: 2}, quantum=3),
    Case("turn beats newcomer", "a never-run job waits for the current turn to end",
         (job(1, last_seq=3, turn_steps=1), job(2)), {0: 1}, quantum=2),
    Case("least recently run", "rotation picks the smallest last_seq, not the smallest id",
         (job(1, last_seq=9, turn_steps=1), job(2, last_seq=8), job(3, last_seq=5)), {0: 3}),
    Case("current is largest last_seq", "a stale turn_steps on another job does not make it current",
         (job(1, last_seq=9, turn_steps=1), job(2, last_seq=5, turn_steps=3)), {0: 1}, quantum=2),
    Case("lanes rotate independently", "each lane has its own turn",
         (job(1, lane=0, last_seq=10, turn_steps=2), job(2, lane=0, last_seq=3),
          job(3, lane=1, last_seq=11, turn_steps=1), job(4, lane=1, last_seq=2)),
         {0: 2, 1: 3}, quantum=2),
    Case("closed lane skipped", "jobs in a lane that is not open are never named",
         (job(1, lane=0), job(2, lane=5)), {0: 1}, lanes=(0,)),
]


@pytest.mark.parametrize("case", PACK, ids=ids(PACK))
def test_pack(case):
    check("pack", case)


SRTF = [
    Case("single job", "the only job runs", (job(1, lane=1),), {1: 1}),
    Case("least remaining", "fewer seconds left wins",
         (job(1, steps_left=10), job(2, steps_left=5)), {0: 2}),
    Case("time not steps", "remaining = steps_left * step_time_s: 10 x 0.1 s beats 5 x 1 s",
         (job(1, steps_left=10, step_time_s=0.1), job(2, steps_left=5, step_time_s=1.0)), {0: 1}),
    Case("host time counts", "remaining = steps_left * (step_time_s + host_s): on a host-bound "
         "CPU 4000 cheap steps (30 us device + 45 us host) outlast 900 costly ones (200 + 45 us), "
         "though by device time alone they look shorter",
         (job(1, steps_left=4000, step_time_s=30e-6, host_s=45e-6),
          job(2, steps_left=900, step_time_s=200e-6, host_s=45e-6)), {0: 2}),
    Case("a stale pace gives way to its form's", "the jct trace's 4,056-step job ran its first "
         "steps one per call beside three compiles (129 us + 1.3 ms of host time a step) and was "
         "preempted: its K=32 form runs a step in 87 us (form_step_s), so 3,700 of them (0.32 s) "
         "beat 1,424 of a 128-wide job's (231 us in its form: 0.33 s), not 4.8 s against 0.52",
         (job(1, steps_left=3700, step_time_s=129e-6, host_s=1296e-6, form_step_s=87e-6),
          job(2, steps_left=1424, step_time_s=270e-6, host_s=95e-6, form_step_s=231e-6)), {0: 1}),
    Case("its own pace where faster than its form's", "the lesser of the two: a form timed beside "
         "a compile never makes a job that runs faster rank slower (1,000 x 100 us, not x 500 us)",
         (job(1, steps_left=1000, step_time_s=100e-6, form_step_s=500e-6),
          job(2, steps_left=300, step_time_s=400e-6)), {0: 1}),
    Case("unknown length last", "steps_left None counts as infinite",
         (job(1, steps_left=None), job(2, steps_left=1000)), {0: 2}),
    Case("all unknown by arrival", "infinite ties fall back to arrival",
         (job(1, steps_left=None, arrival=3.0), job(2, steps_left=None, arrival=1.0)), {0: 2}),
    Case("tie by arrival", "equal remaining: earlier arrival",
         (job(1, steps_left=4, arrival=2.0), job(2, steps_left=2, step_time_s=2.0, arrival=1.0)), {0: 2}),
    Case("tie by id", "equal remaining and arrival: smaller id",
         (job(2, arrival=1.0), job(1, arrival=1.0)), {0: 1}),
    Case("preempted by arrival", "a shorter job arriving mid-run wins the next pick",
         (job(1, steps_left=50, last_seq=99, turn_steps=50), job(2, steps_left=2, arrival=60.0)), {0: 2}),
    Case("exclusive across lanes", "only the shortest job runs device-wide, in its own lane",
         (job(1, lane=0, steps_left=9), job(2, lane=1, steps_left=3), job(3, lane=2, steps_left=6)), {1: 2}),
    Case("ignores priority", "srtf looks at remaining time only",
         (job(1, priority=9, steps_left=9), job(2, steps_left=3)), {0: 2}),
]


@pytest.mark.parametrize("case", SRTF, ids=ids(SRTF))
def test_srtf(case):
    check("srtf", case)


FAIR = [
    Case("least device time", "within a lane the job with least device time runs",
         (job(1, device_time_s=5.0), job(2, device_time_s=3.0)), {0: 2}),
    Case("device time not steps", "a job with many cheap steps is behind one with few slow ones",
         (job(1, steps_done=100, device_time_s=10.0, step_time_s=0.1),
          job(2, steps_done=5, device_time_s=12.0, step_time_s=2.0)), {0: 1}),
    Case("tie by last_seq", "equal device time: the least recently run",
         (job(1, device_time_s=2.0, last_seq=7), job(2, device_time_s=2.0, last_seq=4)), {0: 2}),
    Case("never-run first", "equal device time: a never-run job (last_seq -1) first",
         (job(1, device_time_s=0.0, last_seq=3), job(2)), {0: 2}),
    Case("tie by arrival", "equal device time and last_seq: earlier arrival",
         (job(1, arrival=2.0), job(2, arrival=1.0)), {0: 2}),
    Case("tie by id", "all else equal: smaller id",
         (job(2, arrival=1.0), job(1, arrival=1.0)), {0: 1}),
    Case("lanes in parallel", "single-job lanes within one step of each other run together",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=10.5)), {0: 1, 1: 2}),
    Case("slack boundary", "a lead of exactly quantum * step_time_s still runs (<=)",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=11.0)), {0: 1, 1: 2}),
    Case("ahead lane idles", "a lane ahead by more than a turn idles so the starved job catches up",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=11.5)), {0: 1}),
    Case("quantum widens slack", "with quantum 2 a lead of 1.5 steps is within one turn",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=11.5)), {0: 1, 1: 2}, quantum=2),
    Case("slack in own step time", "slack is the candidate's step time: 2 s ahead with 3 s steps runs",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=12.0, step_time_s=3.0)), {0: 1, 1: 2}),
    Case("min over all lanes", "the starved job in lane 2 makes both other lanes idle",
         (job(1, lane=0, device_time_s=20.0), job(2, lane=1, device_time_s=30.0),
          job(3, lane=2, device_time_s=1.0)), {2: 3}),
    Case("closed lane ignored", "a job in a closed lane neither runs nor holds back the others",
         (job(1, lane=0, device_time_s=10.0), job(2, lane=1, device_time_s=10.0),
          job(3, lane=7, device_time_s=0.0)), {0: 1, 1: 2}, lanes=(0, 1)),
]


@pytest.mark.parametrize("case", FAIR, ids=ids(FAIR))
def test_fair(case):
    check("fair", case)


PRIORITY = [
    Case("highest priority", "larger priority wins", (job(1), job(2, priority=5)), {0: 2}),
    Case("negative priorities", "-1 outranks -3",
         (job(1, priority=-3), job(2, priority=-1)), {0: 2}),
    Case("tie by arrival", "equal priority: earlier arrival",
         (job(1, priority=2, arrival=4.0), job(2, priority=2, arrival=3.0)), {0: 2}),
    Case("tie by id", "equal priority and arrival: smaller id",
         (job(2, arrival=1.0), job(1, arrival=1.0)), {0: 1}),
    Case("preempted by arrival", "a higher-priority job arriving mid-run wins the next pick",
         (job(1, last_seq=50, turn_steps=10), job(2, priority=1, arrival=60.0)), {0: 2}),
    Case("ignores length", "strict priority: a long important job beats a short one",
         (job(1, priority=1, steps_left=None), job(2, steps_left=1)), {0: 1}),
    Case("exclusive across lanes", "one job device-wide, in its own lane",
         (job(1, lane=0), job(2, lane=1, priority=3), job(3, lane=2, priority=2)), {1: 2}),
]


@pytest.mark.parametrize("case", PRIORITY, ids=ids(PRIORITY))
def test_priority(case):
    check("priority", case)


# --- multi-step runs: drive a policy the way the runtime does --------------------------------


def simulate(policy_name, jobs, *, lanes=None, quantum=1, steps=100, picks_per_step=3, arrivals=None):
    """Step jobs under a policy, keeping last_seq/turn_steps/device time as the runtime does.

    ``pick`` is called ``picks_per_step`` times per dispatched step, threading the state, because
    lane threads may each ask: a policy that counts calls instead of reading last_seq breaks here.
    ``arrivals`` maps a step index to jobs submitted then. Returns one decision dict per step.
    """
    policy = get_policy(policy_name)
    state = policy.init()
    live = {j.id: j for j in jobs}
    lanes = lanes if lanes is not None else tuple(sorted({j.lane for j in jobs}))
    seq, trace = 0, []
    for t in range(steps):
        for j in (arrivals or {}).get(t, ()):
            live[j.id] = replace(j, arrival=float(t))
        if not live:
            break
        view = View(now=float(t), jobs=tuple(live.values()), lanes=lanes, quantum=quantum)
        for _ in range(picks_per_step):
            decision, state = policy.pick(view, state)
        trace.append(dict(decision.run))
        for lane, jid in sorted(decision.run.items()):
            current = max((j for j in live.values() if j.lane == lane), key=lambda j: j.last_seq)
            turn = live[jid].turn_steps + 1 if current.id == jid and current.last_seq >= 0 else 1
            if current.id != jid:
                live[current.id] = replace(current, turn_steps=0)
            j = live[jid]
            left = None if j.steps_left is None else j.steps_left - 1
            live[jid] = replace(j, steps_done=j.steps_done + 1, steps_left=left, last_seq=seq,
                                turn_steps=turn, device_time_s=j.device_time_s + j.step_time_s)
            seq += 1
            if left == 0:
                del live[jid]
    return trace


def test_pack_round_robin_with_quantum():
    """Three jobs sharing a lane take turns of exactly `quantum` steps, in arrival order."""
    trace = simulate("pack", [job(1), job(2), job(3)], quantum=2, steps=12)
    assert [d[0] for d in trace] == [1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3]


def test_pack_fills_lanes_every_step():
    """Two lanes, two jobs each: both lanes step every iteration, each rotating on its own."""
    trace = simulate("pack", [job(1, lane=0), job(2, lane=0), job(3, lane=1), job(4, lane=1)], steps=4)
    assert trace == [{0: 1, 1: 3}, {0: 2, 1: 4}, {0: 1, 1: 3}, {0: 2, 1: 4}]


def test_fair_equalises_device_time():
    """Steps of 1 s and 3 s in one lane: the cheap job gets about 3 steps per expensive one,
    and device times never drift more than one step apart."""
    trace = simulate("fair", [job(1, step_time_s=1.0, steps_left=None),
                              job(2, step_time_s=3.0, steps_left=None)], steps=80)
    ran = [d[0] for d in trace]
    t1, t2 = ran.count(1) * 1.0, ran.count(2) * 3.0
    assert abs(t1 - t2) <= 3.0
    assert ran.count(1) == pytest.approx(3 * ran.count(2), abs=3)


def test_fair_single_job_lanes_overlap():
    """Equal single-job lanes both run at every step: the slack keeps lanes parallel."""
    trace = simulate("fair", [job(1, lane=0, steps_left=None), job(2, lane=1, steps_left=None)], steps=20)
    assert all(d == {0: 1, 1: 2} for d in trace)


def test_srtf_preempts_for_new_short_job():
    """A long job runs alone; a 3-step job arriving at step 5 takes over at once, then it resumes."""
    trace = simulate("srtf", [job(1, steps_left=20)], arrivals={5: [job(2, steps_left=3)]}, steps=12)
    assert [d[0] for d in trace] == [1] * 5 + [2] * 3 + [1] * 4


def test_priority_preempts_then_resumes():
    """A higher-priority job arriving mid-run owns the device until done; ties go by arrival."""
    trace = simulate("priority", [job(1, steps_left=10)],
                     arrivals={3: [job(2, priority=1, steps_left=2), job(3, steps_left=2)]}, steps=14)
    assert [d[0] for d in trace] == [1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1, 3, 3]


def test_fifo_runs_to_completion_in_arrival_order():
    """Exclusive baseline: each job runs all its steps before the next starts."""
    trace = simulate("fifo", [job(2, lane=1, steps_left=2), job(1, lane=0, steps_left=3)], steps=10)
    assert trace == [{0: 1}] * 3 + [{1: 2}] * 2


def test_srtf_with_two_slots_runs_the_two_shortest_in_distinct_lanes():
    from xshare.sched import JobView, View, get_policy

    def job(i, lane, left):
        return JobView(id=i, name=f"j{i}", arrival=float(i), priority=0, steps_done=0, steps_left=left,
                       step_time_s=1.0, device_time_s=0.0, lane=lane, last_seq=-1, turn_steps=0)

    policy = get_policy("srtf")
    # j2 (3 left) and j1 (5 left) share lane 0, so lane 0 runs j2 and the second slot goes to the
    # shortest job elsewhere: j3 in lane 1 (9 left), not the longer j0 in lane 2.
    view = View(now=0.0, jobs=(job(0, 2, 20), job(1, 0, 5), job(2, 0, 3), job(3, 1, 9)), lanes=(0, 1, 2), slots=2)
    decision, _ = policy.pick(view, policy.init())
    assert dict(decision.run) == {0: 2, 1: 3}
    one, _ = policy.pick(View(now=0.0, jobs=view.jobs, lanes=view.lanes, slots=1), None)
    assert dict(one.run) == {0: 2}


@pytest.mark.parametrize("a_time, b_time, turns, why", [
    (0.0, 0.0, 1, "equal device time: alternate, one turn each"),
    (0.0, 0.0095, 10, "9.5 ms behind at 1 ms a step: it runs 10 turns (1 + 9 whole steps of gap)"),
    (0.0, 5.0, 32, "far behind: capped at 32 turns per decision, the next decision continues"),
])
def test_fair_lets_a_starved_job_catch_up_in_one_rotation(a_time, b_time, turns, why):
    view = View(now=0.0, lanes=(0,), jobs=(job(1, device_time_s=a_time, step_time_s=1e-3),
                                          job(2, device_time_s=b_time, step_time_s=1e-3)))
    decision, _ = get_policy("fair").pick(view, None)
    assert decision.order[0] == (1,) * turns + (2,), why


def test_a_starved_jobs_catch_up_counts_its_k_step_calls():
    # 9.5 ms behind at 1 ms a step: 10 turns of single steps, but a turn of a job with a K=4
    # program may run 4 steps, so 3 turns (1 + 2 whole calls of gap) catch it up, not 10 x 4 steps.
    jobs = (job(1, device_time_s=0.0, step_time_s=1e-3, call_steps=4), job(2, device_time_s=0.0095, step_time_s=1e-3))
    decision, _ = get_policy("fair").pick(View(now=0.0, lanes=(0,), jobs=jobs), None)
    assert decision.order[0] == (1, 1, 1, 2)
