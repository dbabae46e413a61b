"""``xshare bench --smoke`` end to end: every mode runs, every output file is well formed.

The numbers are not checked (a smoke run measures nothing); the shapes are."""

from __future__ import annotations

import json

import pytest

from xshare.bench.report import FIGURES
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
    assert results["schema"] == "xshare.bench/v1"
    assert {"date", "command", "machine", "config", "calibration", "workloads", "overhead", "targets"} <= set(results)
    assert results["calibration"]["peak_flops_per_s"] > 0
    (wl,) = results["workloads"].values()
    assert len(wl["jobs"]) == 2
    assert list(wl["modes"]) == list(MODES)
    for mode in MODES:
        m = wl["modes"][mode]
        assert m["ok_runs"] == m["runs_total"] == 1, m["runs"]
        assert m["complete"], m["runs"]
        assert set(FIGURES) <= set(m["median"])
        for key in ("makespan_s", "avg_jct_s", "steps_per_s", "peak_rss_bytes", "utilization"):
            assert m["median"][key] is not None and m["median"][key] > 0, (mode, key)
        assert set(FIGURES) <= set(m["ratio_to_exclusive"])
        assert [j["name"] for j in m["jobs"]] == [j["name"] for j in wl["jobs"]]
    assert wl["modes"]["exclusive"]["ratio_to_exclusive"]["steps_per_s"] == pytest.approx(1.0)
    assert wl["modes"]["processes"]["runs"][0]["steps"] == wl["total_steps"]
    assert "profile" in wl["modes"]["xshare:pack"]
    assert results["overhead"]["overhead_percent"] is not None

    png = (out / "results.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 1000

    md = (out / "results.md").read_text()
    assert "| mode | makespan (s) | x excl |" in md
    for mode in MODES:
        assert f"| `{mode}` |" in md
    assert "xshare bench --smoke" in md
    assert "smoke" in printed and "results.json" in printed


def test_bad_mode_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--modes", "exclusive,xshare:nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown mode 'xshare:nope'" in err and "xshare:<policy>" in err


def test_unknown_workload_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--workload", "sweep9", "--out", str(tmp_path)]) == 2
    assert "unknown workload 'sweep9'" in capsys.readouterr().err


def test_modes_parse_and_lanes_option():
    from xshare.bench.modes import mode_spec, parse_modes

    assert parse_modes("exclusive, xshare ,xshare:fair:lanes=2,exclusive") == (
        "exclusive", "xshare:pack", "xshare:fair:lanes=2")
    assert mode_spec("xshare:fair:lanes=2") == ("xshare", "fair", {"max_lanes": 2})
    with pytest.raises(ValueError, match="lanes=N"):
        parse_modes("xshare:pack:lanes=0")


def test_workloads_expand_like_launch_specs():
    from xshare.bench.workloads import resolve

    sweep = resolve("sweep8")
    assert len(sweep.jobs) == 8
    assert len({j.name for j in sweep.jobs}) == 8
    assert sweep.jobs[0].name.startswith("0_lr=0.001,width=")
    assert all(j.entry == "models.mlp:make_job" for j in sweep.jobs)
    assert {j.steps for j in resolve("sweep8", steps=7).jobs} == {7}
