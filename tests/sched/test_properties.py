"""Invariants every policy must keep, over random views (hypothesis).

The runtime trusts a decision blindly, so these are the safety properties: only open lanes,
only runnable jobs, each job in its own lane, one job per lane, exclusive policies run at most
one job, and the answer depends on the view alone (not on call count or job order).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xshare.sched import POLICIES, JobView, View, get_policy

EXCLUSIVE = {"fifo": True, "pack": False, "srtf": True, "fair": False, "priority": True}


@st.composite
def views(draw) -> View:
    lanes = draw(st.lists(st.integers(0, 5), unique=True, max_size=4))
    n = draw(st.integers(0, 8))
    ids = draw(st.lists(st.integers(0, 1000), unique=True, min_size=n, max_size=n))
    # last_seq is a global dispatch counter: unique among jobs that ran, -1 for the rest.
    seqs = draw(st.lists(st.integers(0, 10_000), unique=True, min_size=n, max_size=n))
    small = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
    jobs = []
    for jid, seq in zip(ids, seqs):
        ran = draw(st.booleans())
        jobs.append(JobView(
            id=jid, name=f"j{jid}",
            arrival=draw(st.sampled_from([0.0, 1.0, 2.5]) | small),  # small pool: force ties
            priority=draw(st.integers(-3, 3)),
            steps_done=draw(st.integers(0, 100)),
            steps_left=draw(st.none() | st.integers(0, 100)),
            step_time_s=draw(st.sampled_from([0.5, 1.0]) | st.floats(1e-6, 100, allow_nan=False)),
            device_time_s=draw(st.sampled_from([0.0, 1.0]) | small),
            lane=draw(st.integers(0, 6)),  # some jobs may sit in lanes that are not open
            last_seq=seq if ran else -1,
            turn_steps=draw(st.integers(0, 4)) if ran else 0,
        ))
    return View(now=draw(small), jobs=tuple(jobs), lanes=tuple(lanes), quantum=draw(st.integers(1, 4)))


def pick(name: str, view: View):
    policy = get_policy(name)
    return policy.pick(view, policy.init())


@settings(max_examples=300, deadline=None)
@given(view=views(), data=st.data())
def test_decisions_obey_invariants(view, data):
    by_id = {j.id: j for j in view.jobs}
    open_jobs = [j for j in view.jobs if j.lane in view.lanes]
    for name in POLICIES:
        decision, state = pick(name, view)
        run = dict(decision.run)
        # only open lanes, only runnable jobs, each job in its own lane
        assert set(run) <= set(view.lanes), name
        assert all(jid in by_id and by_id[jid].lane == lane for lane, jid in run.items()), name
        # at most one job per lane is structural (a mapping); no job is named twice
        assert len(set(run.values())) == len(run), name
        assert state == get_policy(name).init(), name
        if EXCLUSIVE[name]:
            assert len(run) <= 1, name
        # work conserving: if anything can run, something runs
        assert bool(run) == bool(open_jobs), name
        if name == "pack":
            assert set(run) == {j.lane for j in open_jobs}
        # deterministic, and independent of the order of view.jobs and view.lanes
        shuffled = View(now=view.now, jobs=tuple(data.draw(st.permutations(view.jobs))),
                        lanes=tuple(data.draw(st.permutations(view.lanes))), quantum=view.quantum)
        assert pick(name, view)[0] == decision, name
        assert pick(name, shuffled)[0] == decision, name


@settings(max_examples=100, deadline=None)
@given(view=views())
def test_repeated_picks_with_threaded_state_agree(view):
    """Lane threads may each call pick for one step: the answer must not drift with call count."""
    for name in POLICIES:
        policy = get_policy(name)
        state = policy.init()
        first, state = policy.pick(view, state)
        for _ in range(3):
            again, state = policy.pick(view, state)
            assert again == first, name
