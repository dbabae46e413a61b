"""engine/source.py: the batches ``produce`` makes for a K-step or group call in one loop
(``_produce_stacked``) are, item for item, what it makes one batch at a time: the leaves, a
``DataError`` at the step the user's data raised or changed structure, ``END`` at the step count."""

from __future__ import annotations

import collections
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from jax.tree_util import tree_flatten

from xshare.runtime.engine import source as src

CPU = SimpleNamespace(platform="cpu")


def _data(bad_at=None, other_at=None):
    def data(step):
        if step == bad_at:
            raise ValueError(f"no batch {step}")
        if step == other_at:
            return {"x": np.full((2,), step, np.float32)}  # another structure: no "y"
        return {"x": np.full((2,), step, np.float32), "y": np.int32(step)}
    return data


def _job(data, stop, *, stacked=True):
    treedef = tree_flatten(data(0))[1]
    return SimpleNamespace(feed_lock=threading.Lock(), batches=collections.deque(), data_done=False,
                           source=src.BatchSource(data, start=0, stop=stop), data_s=None,
                           batch_layout=SimpleNamespace(plain=True, treedef=treedef),
                           group=object() if stacked else None, tier=None, terminal=False)


def _items(job):
    out = []
    for item in job.batches:
        if item is src.END:
            out.append("END")
        elif isinstance(item, src.DataError):
            out.append(("error", item.step, type(item.error).__name__, str(item.error)))
        else:
            out.append(tuple(np.asarray(x).tolist() for x in item))
    return out


@pytest.mark.parametrize("kw, stop, asks", [
    ({}, None, [32, 32]),                  # plain: two calls' worth
    ({}, 40, [32, 32]),                    # the step count within the second call: END after step 39
    ({}, 32, [32, 5]),                     # ... exactly at a call's end: END is the next call's first item
    ({"bad_at": 7}, None, [32]),           # the data raised at step 7
    ({"other_at": 3}, None, [16]),         # step 3's batch has another structure
])
def test_batches_made_for_stacking_in_one_loop_are_those_made_one_at_a_time(monkeypatch, kw, stop, asks):
    bulk = _job(_data(**kw), stop)
    for n in asks:
        assert src.produce(bulk, CPU, n=n)
    # The same asks, one batch per loop (the path every other source takes).
    monkeypatch.setattr(src.BatchSource, "seekable", lambda self: False)
    single = _job(_data(**kw), stop)
    for n in asks:
        assert src.produce(single, CPU, n=n)
    assert _items(bulk) == _items(single)
    assert bulk.source is None if single.source is None else bulk.source.next_step == single.source.next_step
    assert bulk.data_s is not None


def test_a_peeked_first_batch_is_served_before_the_loop_takes_over():
    job = _job(_data(), None)
    first = job.source.peek()  # (the compiler read its shapes)
    assert not job.source.seekable()
    assert src.produce(job, CPU, n=4)  # one at a time: the peeked batch first
    assert job.source.seekable()
    assert src.produce(job, CPU, n=4)
    assert [item[0][0] for item in job.batches] == [float(s) for s in range(8)]
    assert np.array_equal(job.batches[0][0], first["x"])


@pytest.mark.parametrize("seekable", [True, False])
def test_a_batch_made_while_its_job_ended_is_dropped_not_kept_by_the_ended_record(monkeypatch, seekable):
    """``Lifecycle.end`` clears a job's batches and drops its source and layout without the feed
    lock (a slow source must not hold up an end). A feeder inside the user's data meanwhile
    appended its batch afterwards: the ended record kept it (on an accelerator, device memory
    outside the ledger), or a DataError about the dropped layout whose traceback held the source.
    Here the data ends the job, as ``end`` does, while making step 2."""
    if not seekable:
        monkeypatch.setattr(src.BatchSource, "seekable", lambda self: False)
    inner = _data()

    def data(step):
        if step == 2:  # the dispatcher's end, in its order: the state first, then the clears
            job.terminal = True
            job.source, job.batch_layout = None, None
            job.batches.clear()
        return inner(step)

    job = _job(data, None, stacked=seekable)
    assert src.produce(job, CPU, n=4)
    assert list(job.batches) == []
    # ... while a live job's batches all land
    job = _job(inner, None, stacked=seekable)
    assert src.produce(job, CPU, n=4) and len(job.batches) == 4
