"""MetricsRows: metrics rows buffered on the dispatcher thread and handed to the recorder in
batches (rows.py), with jax unimportable like the other pure parts."""

from __future__ import annotations

from xshare.runtime.engine.rows import BATCH, MetricsRows


class _Recorder:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def metrics_rows(self, rows: list) -> None:
        self.batches.append(rows)


def test_rows_are_handed_over_in_order_one_batch_per_flush_and_never_empty():
    rec = _Recorder()
    rows = MetricsRows(rec, enabled=True)
    rows.flush()
    assert rec.batches == []  # nothing buffered: the recorder is not woken
    rows.add("a", 0, 1.0, [0.5], None)
    rows.add("a", 1, 2.0, [0.25], {"eval/loss": 0.1})
    assert rec.batches == []  # buffered until a flush
    rows.flush()
    assert rec.batches == [[("a", 0, 1.0, [0.5], None), ("a", 1, 2.0, [0.25], {"eval/loss": 0.1})]]
    assert rows.items == []
    rows.flush()
    assert len(rec.batches) == 1
    assert BATCH == 256  # the executor flushes at this many rows (a queue put per batch, not per step)


def test_a_runtime_without_a_log_directory_makes_no_rows():
    rec = _Recorder()
    rows = MetricsRows(rec, enabled=False)
    rows.add("a", 0, 1.0, [0.5], None)
    rows.flush()
    assert rows.items == [] and rec.batches == []
