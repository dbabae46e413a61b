"""The verdict tables' persistence (runtime/compiled/verdict_store.py): a round trip through the
file, a corrupt file ignored with one warning, puts from many threads, and the files the code
before JsonTable wrote (verdicts.json, fusion-verdicts.json) still read. No jax."""

from __future__ import annotations

import json
import logging
import threading

from xshare.runtime.compiled import multistep, payoff
from xshare.runtime.compiled.multistep import Form, Verdict, Verdicts
from xshare.runtime.compiled.payoff import FusionVerdict, FusionVerdicts
from xshare.runtime.compiled.verdict_store import JsonTable


def _table() -> JsonTable[tuple[str, int], float]:
    return JsonTable("t.json", lambda r: ((r["name"], int(r["n"])), float(r["x"])),
                     lambda key, x: {"name": key[0], "n": key[1], "x": x})


def test_a_round_trip_through_the_file(tmp_path):
    a = _table()
    a.persist(tmp_path)
    a.put(("a", 1), 0.5)
    a.put(("b", 2), 1.5)
    a.put(("a", 1), 0.25)  # replaces its row
    assert json.loads((tmp_path / "t.json").read_text()) == [
        {"name": "a", "n": 1, "x": 0.25}, {"name": "b", "n": 2, "x": 1.5}]
    b = _table()
    b.persist(tmp_path)
    assert sorted(b.items()) == [(("a", 1), 0.25), (("b", 2), 1.5)]
    assert not list(tmp_path.glob(".t.json.*"))  # no temporary left behind


def test_memory_wins_over_the_file_and_a_second_persist_reads_nothing(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps([{"name": "a", "n": 1, "x": 1.0}]))
    t = _table()
    t.put(("a", 1), 2.0)  # in memory only
    t.persist(tmp_path)
    assert t.get(("a", 1)) == 2.0
    (tmp_path / "t.json").write_text(json.dumps([{"name": "c", "n": 3, "x": 3.0}]))
    t.persist(tmp_path)
    assert t.get(("c", 3)) is None and t.path == tmp_path / "t.json"


def test_a_table_without_a_directory_writes_nothing(tmp_path):
    t = _table()
    t.persist(None)
    t.put(("a", 1), 1.0)
    assert t.get(("a", 1)) == 1.0 and t.path is None
    t.clear()
    assert t.get(("a", 1)) is None


def test_a_corrupt_file_is_ignored_with_one_warning_and_then_replaced(tmp_path, caplog):
    for text in ["{not json", json.dumps({"name": "a"}), json.dumps([{"name": "a", "n": "one", "x": 1}]),
                 json.dumps([["a", 1, 1.0]])]:
        (tmp_path / "t.json").write_text(text)
        caplog.clear()
        t = _table()
        with caplog.at_level(logging.WARNING, logger="xshare.runtime"):
            t.persist(tmp_path)
            t.put(("a", 1), 1.0)  # reads the file again: no second warning
        assert t.items() == [(("a", 1), 1.0)], text
        assert len(caplog.records) == 1 and "t.json" in caplog.records[0].getMessage(), text
        assert json.loads((tmp_path / "t.json").read_text()) == [{"name": "a", "n": 1, "x": 1.0}]


def test_an_unwritable_directory_keeps_the_verdicts_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    t = _table()
    t.persist(blocker / "cache")  # a path under a file: mkdir fails
    t.put(("a", 1), 1.0)
    assert t.get(("a", 1)) == 1.0


def test_puts_from_many_threads_all_land_in_memory_and_in_the_file(tmp_path):
    t = _table()
    t.persist(tmp_path)
    start = threading.Barrier(8)

    def put(i):
        start.wait()
        for j in range(25):
            t.put((f"t{i}", j), float(i * 100 + j))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    want = {(f"t{i}", j): float(i * 100 + j) for i in range(8) for j in range(25)}
    assert dict(t.items()) == want
    again = _table()
    again.persist(tmp_path)
    assert dict(again.items()) == want


def test_a_verdicts_json_written_before_the_table_still_loads(tmp_path):
    # verbatim what multistep._write wrote (one row without "why", as the earliest files had)
    (tmp_path / multistep.FILE).write_text(
        '[{"program": "p1", "k": 8, "unroll": false, "exact": true, "single_step_s": 0.0001, '
        '"multi_step_s": 5e-05, "why": ""}, {"program": "p1", "k": 4, "unroll": true, "exact": false, '
        '"single_step_s": 0.0001, "multi_step_s": 8e-05, "why": "state leaf 0 differs"}, '
        '{"program": "p2", "k": 2, "unroll": false, "exact": true, "single_step_s": 2e-05, "multi_step_s": 1e-05}]')
    v = Verdicts()
    v.persist(str(tmp_path))
    assert v.get("p1", Form(8, False)) == Verdict(Form(8, False), True, 1e-4, 5e-5, "")
    old_inexact = v.get("p1", Form(4, True))  # how far apart it was is unknown: NaN, checked again under a tolerance
    assert old_inexact == Verdict(Form(4, True), False, 1e-4, 8e-5, "state leaf 0 differs", old_inexact.deviation)
    assert not old_inexact.measured and not old_inexact.usable(1e-3)
    assert v.get("p2", Form(2, False)) == Verdict(Form(2, False), True, 2e-5, 1e-5, "")
    assert len(v.of("p1")) == 2
    v.put("p3", Verdict(Form(16, False), True, 3e-5, 1e-5))
    rows = json.loads((tmp_path / multistep.FILE).read_text())
    assert rows[-1] == {"program": "p3", "k": 16, "unroll": False, "exact": True, "single_step_s": 3e-5,
                        "multi_step_s": 1e-5, "why": "", "checks": 1, "deviation": 0.0}
    assert len(rows) == 4


def test_the_verdicts_of_the_scan_forms_are_not_taken_for_the_rolled_loops(tmp_path):
    # "verdicts.json" judged rolled forms that were a lax.scan; they are a loop over any n <= K
    # now, another program, checked rather than assumed (multistep.FILE is another file).
    (tmp_path / "verdicts.json").write_text(
        '[{"program": "p1", "k": 8, "unroll": false, "exact": true, "single_step_s": 0.0001, '
        '"multi_step_s": 5e-05, "why": ""}]')
    v = Verdicts()
    v.persist(str(tmp_path))
    assert v.get("p1", Form(8, False)) is None


def test_a_fusion_verdicts_json_written_before_the_table_still_loads(tmp_path):
    # verbatim what payoff.FusionVerdicts.put wrote
    (tmp_path / "fusion-verdicts.json").write_text(
        '[{"program": "k", "capacity": 4, "solo_step_s": 5e-05, "fused_step_s": 0.0004}]')
    v = FusionVerdicts()
    v.persist(str(tmp_path))
    assert v.get("k", 4) == FusionVerdict(4, 5e-5, 4e-4)
    v.put("k", FusionVerdict(8, 1e-4, 2e-4))
    # (a file from before verdicts counted their measurements, or were timed at K steps a call:
    # each counts as one measurement, at one step per call)
    assert json.loads((tmp_path / payoff.FILE).read_text()) == [
        {"program": "k", "capacity": 4, "solo_step_s": 5e-05, "fused_step_s": 0.0004, "checks": 1, "k": 1},
        {"program": "k", "capacity": 8, "solo_step_s": 1e-4, "fused_step_s": 2e-4, "checks": 1, "k": 1}]
