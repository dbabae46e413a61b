"""The lifecycle on hand-made jobs: one call ends a job, each owner forgets its part, failures
wait for in-flight steps, and a job's end never takes another down."""

from __future__ import annotations

from xshare.runtime.engine.states import Event, JobState

from . import fakes
from .engine import Parts

S = JobState


def test_end_is_one_call_every_owner_forgets_the_job_and_its_reservation_goes_last():
    parts = Parts(capacity_mib=2)
    a, b = fakes.job("a"), fakes.job("b")
    parts.submit(a, b)
    order = []
    parts.life.forgetters += (lambda job: order.append(("forget", job.name, job.in_ledger, job.arrays)),)
    release = parts.life.release
    parts.life.release = lambda job: (order.append(("release", job.name, job.arrays)), release(job))
    parts.life.end(a, Event.CANCEL)
    assert a.state is S.CANCELLED and a.ended_s == 2.0
    # owners forget it while it still holds its buffers and reservation; the bytes go last,
    # after its buffers were dropped, to the queued job
    assert order == [("forget", "a", True, ["a-state"]), ("release", "a", None)]
    assert parts.forgot == ["a"] and parts.ended == [("a", "cancelled")]
    assert a.id not in parts.units.jobs and a.id not in parts.units.running and a.id not in parts.ledger()
    assert (a.arrays, a.host_arrays, a.source, a.spec.state, a.spec.job) == (None, None, None, None, None)
    assert parts.recorder.said("a")[-1] == "cancelled after 0 steps" and parts.recorder.closed == ["a"]
    assert a.done_event.is_set()
    assert b.state is S.RUNNING
    parts.life.end(a, Event.FAIL)  # a second end of an ended job changes nothing
    assert a.state is S.CANCELLED and parts.ended == [("a", "cancelled")]


def test_a_failure_waits_for_the_jobs_steps_in_flight_then_ends_it():
    parts = Parts(capacity_mib=4)
    a = fakes.job("a")
    parts.submit(a)
    a.in_flight = 2
    err = ValueError("nan in the loss")
    parts.life.fail(a, "step 3 raised: ValueError: nan in the loss", err)
    assert a.state is S.RUNNING and a.error.startswith("step 3 raised") and a.exception is err
    assert a.id not in parts.units.running  # out of the rotation at once
    parts.life.settle(a)
    assert a.state is S.RUNNING  # still in flight
    a.in_flight = 0
    parts.life.settle(a)
    assert a.state is S.FAILED and parts.ended == [("a", "failed")]
    lines = parts.recorder.said("a")
    assert lines[1] == "FAILED: step 3 raised: ValueError: nan in the loss"
    assert "ValueError: nan in the loss" in lines[2]  # its traceback, in its log
    parts.life.fail(a, "a second cause")
    assert a.error.startswith("step 3 raised")  # the first cause stays


def test_a_job_that_ran_its_steps_finishes_with_its_state_read_once_and_checkpointed():
    reads = []
    parts = Parts(capacity_mib=4, checkpoint_dir="ckpt",
                  read_state=lambda job: reads.append(job.name) or {"w": 1})
    a = fakes.job("a", steps=5)
    parts.submit(a)
    a.dispatched = a.steps_done = 5
    parts.life.settle(a)
    assert a.state is S.DONE and a.host_state == {"w": 1} and reads == ["a"]
    assert parts.recorder.checkpoints == [("a", 5, {"w": 1}, True)]
    assert parts.recorder.releasing == []  # keep_results=True (the default): the state stays


def test_under_keep_results_false_only_a_final_checkpoint_releases_the_state_it_holds():
    parts = Parts(capacity_mib=4, checkpoint_dir="ckpt", read_state=lambda job: {"w": job.name})
    parts.life.keep_results = False
    a, b = fakes.job("a", steps=5), fakes.job("b", steps=5)
    parts.submit(a, b)
    a.dispatched = a.steps_done = 5
    b.steps_done = 3
    parts.life.save(b, done=False)  # a periodic checkpoint of a live job: nothing to release
    parts.life.settle(a)
    assert parts.recorder.checkpoints == [("b", 3, {"w": "b"}, False), ("a", 5, {"w": "a"}, True)]
    # The recorder drops a's state once that checkpoint is written (observe/released.py); until
    # then it is in memory, as for any runtime.
    assert parts.recorder.releasing == ["a"] and a.host_state == {"w": "a"}


def test_a_final_state_that_cannot_be_read_fails_the_job_not_the_others():
    def read_state(job):
        if job.name == "a":
            raise RuntimeError("INTERNAL: the last step failed on the device")
        return {"w": 2}

    parts = Parts(capacity_mib=4, read_state=read_state)
    a, b = fakes.job("a", steps=1), fakes.job("b", steps=1)
    parts.submit(a, b)
    for j in (a, b):
        j.dispatched = j.steps_done = 1
        parts.life.settle(j)
    assert a.state is S.FAILED and a.error.startswith("its final state could not be read: RuntimeError")
    assert b.state is S.DONE and b.host_state == {"w": 2}
    assert parts.ledger() == set()


def test_a_job_owing_an_evaluation_does_not_finish_until_it_is_done():
    parts = Parts(capacity_mib=4)
    a = fakes.job("a", steps=1)
    parts.submit(a)
    a.dispatched = a.steps_done = 1
    parts.units.evaluating[a.id] = a
    parts.life.settle(a)
    assert a.state is S.RUNNING
    del parts.units.evaluating[a.id]
    parts.life.settle(a)
    assert a.state is S.DONE


def test_save_checkpoints_a_live_job_at_its_step_and_nothing_without_a_checkpoint_dir():
    parts = Parts(capacity_mib=4, checkpoint_dir="ckpt")
    a = fakes.job("a")
    parts.submit(a)
    a.steps_done = 3
    parts.life.save(a, done=False)
    assert parts.recorder.checkpoints == [("a", 3, {"leaves": ["a-state"]}, False)] and a.state is S.RUNNING
    quiet = Parts(capacity_mib=4)
    b = fakes.job("b")
    quiet.submit(b)
    quiet.life.save(b, done=False)
    assert quiet.recorder.checkpoints == []
