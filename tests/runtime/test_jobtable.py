"""The runtime's job table (runtime/jobtable.py) on its own: ids and names, lookups that name the
known jobs, refusals once closed, waiting, and end listeners that cannot take the dispatcher down."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from tests.helpers import linreg_data, linreg_state, linreg_step
from xshare._errors import XShareError
from xshare.runtime.engine.states import JobState
from xshare.runtime.jobtable import JobTable


def _specs(*names):
    return [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=3, name=n)
            for i, n in enumerate(names)]


def test_jobs_get_ids_in_order_and_are_found_by_name_id_or_handle():
    table, arrived = JobTable(t0=0.0), []
    jobs = table.add(_specs("a", "b"), runtime=None, arrived=arrived.append)
    assert [j.id for j in jobs] == [0, 1] and arrived == jobs
    assert [h.name for h in table.all_handles()] == ["a", "b"] and table.jobs() == tuple(jobs)
    h = table.lookup("b")
    assert table.lookup(1) is h and table.lookup(h) is h and h._rec is jobs[1]
    with pytest.raises(KeyError, match=re.escape("no job 'c' in this runtime; jobs: a, b")):
        table.lookup("c")
    with pytest.raises(ValueError, match="already submitted"):
        table.add(_specs("a"), runtime=None, arrived=arrived.append)
    with pytest.raises(TypeError, match="takes a JobSpec"):
        table.add(["a"], runtime=None, arrived=arrived.append)  # type: ignore[list-item]


def test_a_closed_table_takes_no_jobs_and_closes_once():
    table = JobTable(t0=0.0)
    assert table.close() is True and table.close() is False
    with pytest.raises(XShareError, match="closed"):
        table.add(_specs("a"), runtime=None, arrived=lambda job: None)


def test_wait_times_out_on_unfinished_jobs_and_listeners_never_raise(caplog):
    table = JobTable(t0=0.0)
    (job,) = table.add(_specs("a"), runtime=None, arrived=lambda job: None)
    assert table.wait(timeout=0.05) is False and table.unfinished() == [job]
    seen = []

    def broken(j):
        raise RuntimeError("boom")

    table.end_listeners += [broken, seen.append]
    job.state = JobState.DONE
    with caplog.at_level(logging.ERROR, logger="xshare.runtime"):
        table.ended(job)
    assert seen == [job] and "a job-end listener raised" in caplog.text
    assert table.wait(timeout=1.0) is True and table.unfinished() == []


def test_wait_survives_jobs_submitted_from_another_thread_while_it_looks():
    """``wait`` looks at every record while callers' threads add more (``add`` takes the table's
    lock, ``wait`` does not). Over the live dict, a record added between two of its checks raised
    "dictionary changed size during iteration" in the waiting thread (``Runtime.wait``, the end
    of a ``with Runtime()``). Here each check lands a submission from "another thread"."""
    table = JobTable(t0=0.0)
    added = []

    class Ended:
        @property
        def terminal(self):
            added.append(len(table.records))
            table.records[1000 + len(added)] = SimpleNamespace(terminal=True)  # (another thread's add)
            return True

    table.records[0] = Ended()
    assert table.wait(timeout=5) is True
    assert added == [1]  # it looked once at the one record there when it began, and returned
