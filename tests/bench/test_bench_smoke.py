"""``xshare bench`` end to end (smoke) and the harness's pieces. The numbers are never checked
(a smoke run measures nothing, and benchmarks are not timed tests); shapes and names are."""

from __future__ import annotations

import json
import math

import pytest

from xshare.bench import harness as H
from xshare.bench.sharing import FIGURES, mode_spec, parse_modes, workload
from xshare.cli.main import main

MODES = ("exclusive", "xshare:pack", "processes", "threads")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_smoke_run_writes_json_png_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--smoke", "--modes", ",".join(MODES), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed

    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "xshare.bench/v1" and results["smoke"] is True
    (wl,) = results["workloads"].values()
    assert len(wl["jobs"]) == 2
    assert list(wl["modes"]) == list(MODES)
    for mode in MODES:
        m = wl["modes"][mode]
        assert m["ok_runs"] == m["runs_total"] == 1 and not m["errors"], m
        for key in ("makespan_s", "avg_jct_s", "steps_per_s", "peak_rss_mib"):
            assert m["median"][key] > 0, (mode, key)
        (run,) = m["runs"]
        assert sum(j["steps"] for j in run["jobs"]) == 20  # 2 jobs x 10 steps, every one done
    assert wl["modes"]["exclusive"]["ratio_to_exclusive"]["steps_per_s"] == pytest.approx(1.0)
    assert wl["modes"]["xshare:pack"]["runs"][0]["extra"]["policy"] == "pack"
    assert math.isfinite(results["overhead"]["overhead_percent"])

    assert (out / "results.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "results.md").read_text()
    for mode in MODES:
        assert f"| `{mode}`" in md
    assert "xshare bench" in md and "Single-job overhead" in md
    assert "results.json" in printed


def test_bad_mode_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--modes", "exclusive,xshare:nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown mode 'xshare:nope'" in err and "xshare:<policy>" in err


def test_unknown_workload_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--workload", "sweep9", "--out", str(tmp_path)]) == 2
    assert "unknown workload 'sweep9'" in capsys.readouterr().err


def test_modes_parse_and_lanes_option():
    assert parse_modes("exclusive, xshare ,xshare:fair:lanes=2,exclusive") == (
        "exclusive", "xshare:pack", "xshare:fair:lanes=2")
    assert mode_spec("xshare:fair:lanes=2") == ("xshare", {"policy": "fair", "max_lanes": 2})
    with pytest.raises(ValueError, match="lanes=N"):
        parse_modes("xshare:pack:lanes=0")


def test_workloads_expand_like_launch_specs():
    _, sweep = workload("sweep8")
    assert len(sweep) == 8 and len({j.name for j in sweep}) == 8
    assert sweep[0].name.startswith("0_lr=0.001,width=")
    assert all(j.entry == "xshare.models.mlp:make_job" for j in sweep)
    assert {j.steps for j in workload("sweep8", steps=7)[1]} == {7}
    _, zoo = workload("zoo")
    assert [j.name[0] for j in zoo] == ["0", "1", "2", "3"]  # one numbering across tables


def test_alternate_rotates_the_order_and_ratios_pair_repeats():
    calls = []
    runs = H.alternate({k: (lambda k=k: calls.append(k) or k) for k in "abc"}, repeats=3, log=None)
    assert calls == list("abc" "bca" "cab")
    assert runs == {"a": ["a"] * 3, "b": ["b"] * 3, "c": ["c"] * 3}
    assert H.paired_ratios([2.0, 3.0], [1.0, 0.0]) == [2.0, pytest.approx(math.nan, nan_ok=True)]
    assert H.median([3.0, None, float("nan"), 1.0]) == 2.0
    with pytest.raises(ValueError, match="repeats=0"):
        H.alternate({"a": lambda: 1}, 0)


def test_markdown_table_and_stats():
    lines = H.markdown_table(["a", "bb"], [[1.23456, None], ["x", float("nan")]]).splitlines()
    assert lines[0] == "| a    | bb  |"
    assert lines[2] == "| 1.23 | n/a |"
    assert lines[3] == "| x    | n/a |"
    assert H.markdown_row(["plain", 0.000123456, 1234.5]) == "| plain | 0.000123 | 1234 |" or \
        H.markdown_row(["plain", 0.000123456, 1234.5]) == "| plain | 0.000123 | 1235 |"
    s = H.summary([1.0, 2.0, 3.0, 100.0])
    assert s["n"] == 4 and s["median"] == 2.5 and s["max"] == 100.0
    assert H.summary([])["n"] == 0


def test_the_figures_have_labels():
    assert set(FIGURES) >= {"makespan_s", "steps_per_s", "peak_rss_mib"}
