"""The runtime's HTTP status API against a real runtime running real jobs: /status and its
schema, /metrics as Prometheus text, token-guarded control, loopback binding, discovery, and
nonsense requests that must never hurt the runtime."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from typing import Any
from urllib.parse import quote

import pytest

from xshare.runtime.web import server as server_mod
from xshare.runtime.observe import schema as status_mod
from xshare.runtime.web.server import MAX_BODY_BYTES, discover

from tests.status import ODD, get_status, job_row, request, runtime_dir, serving, wait_for  # noqa: F401

NAMES = ("alpha", "beta", ODD)


def steps_of(rt, name: str) -> int:
    return job_row(get_status(rt), name)["steps_done"]


def steady(rt, name: str) -> int | None:
    """The job's step count if it did not change over 0.2 s (its in-flight steps drained)."""
    first = steps_of(rt, name)
    time.sleep(0.2)
    return first if steps_of(rt, name) == first else None


# ----------------------------------------------------------------------------------- /status

def test_status_follows_the_schema_and_names_every_job(runtime_dir):
    with serving(NAMES) as rt:
        wait_for(lambda: all(j["steps_done"] >= 5 for j in get_status(rt)["jobs"]), what="5 steps each")
        s = get_status(rt)
        assert status_mod.validate(s) == []
        assert s["schema"] == "xshare.status/v1"
        assert sorted(j["name"] for j in s["jobs"]) == sorted(NAMES)
        assert s["runtime"]["pid"] == os.getpid() and s["runtime"]["policy"] == "fair"
        assert s["device"]["platform"] == "cpu"
        # no GPU here: every NVML figure is unknown, not zero
        assert s["device"]["utilization_percent"] is None and s["device"]["memory_used_bytes"] is None
        arena = s["arena"]
        assert arena["capacity_bytes"] == 64 * 2**20
        assert arena["committed_bytes"] + arena["free_bytes"] == arena["capacity_bytes"]
        assert arena["committed_bytes"] == sum(lane["size_bytes"] for lane in s["lanes"])
        assert sorted(n for lane in s["lanes"] for n in lane["jobs"]) == sorted(NAMES)
        for lane in s["lanes"]:
            assert lane["size_bytes"] == lane["persistent_bytes"] + lane["ephemeral_bytes"]
            assert lane["ephemeral_peak_bytes"] >= lane["ephemeral_bytes"] > 0
            busy = lane["steps_in_flight"] > 0
            assert lane["in_use_bytes"] == lane["persistent_bytes"] + (lane["ephemeral_bytes"] if busy else 0)
        for j in s["jobs"]:
            assert j["status"] == "running" and j["lane"] is not None
            assert j["steps_total"] == 100_000 and j["steps_per_s"] > 0
            assert 0 < j["step_time_p50_s"] <= j["step_time_p95_s"]
            assert j["persistent_bytes"] > 0 and j["ephemeral_bytes"] > 0
            assert set(j["metrics"]) == {"loss"}
        shares = [j["device_time_share"] for j in s["jobs"]]
        assert sum(shares) == pytest.approx(1.0)
        assert {j["priority"] for j in s["jobs"]} == {0, 1, 2}


def test_inspect_reads_one_instant_on_the_dispatcher_thread():
    """``rt.inspect`` (what ``snapshot()`` is built from) hands its function a frozen view, on
    the dispatcher thread, and returns what the function returns."""
    import dataclasses
    import threading

    with serving(("a", "b"), steps=50) as rt:
        seen = rt.inspect(lambda v: (threading.current_thread().name, [j.name for j in v.jobs], v.closed,
                                     v.policy, v.arena is rt.arena))
        view = rt.inspect(lambda v: v)
    assert seen[0] == "xshare-dispatcher"
    assert seen[1:] == (["a", "b"], False, "fair", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.closed = True  # type: ignore[misc]


def test_the_schema_rejects_what_it_forbids():
    # The tests lean on the schema; make sure it is not a yes-man (jsonschema does the checking).
    doc = _document()
    assert status_mod.validate(doc) == []
    assert status_mod.validate({**doc, "extra": 1}) == [
        "$: Additional properties are not allowed ('extra' was unexpected)"]
    bad_job = {**doc["jobs"][0], "lane": -1}
    assert status_mod.validate({**doc, "jobs": [bad_job]}) == ["$.jobs[0].lane: -1 is less than the minimum of 0"]
    no_steps = {k: v for k, v in doc["jobs"][0].items() if k != "steps_done"}
    assert status_mod.validate({**doc, "jobs": [no_steps]}) == ["$.jobs[0]: 'steps_done' is a required property"]
    assert status_mod.validate({**doc, "schema": "xshare.status/v2"}) == [
        "$.schema: 'xshare.status/v1' was expected"]
    hist = {"bounds_s": [0.001, 0.01], "counts": [3, 1, 0], "sum_s": 0.02, "count": 4}
    assert status_mod.validate({**doc, "jobs": [{**doc["jobs"][0], "step_time_histogram": hist}]}) == []


def _document(**job: Any) -> dict[str, Any]:
    """A complete status document with one job (every field the schema requires)."""
    return {
        "schema": "xshare.status/v1", "time_unix_s": 1e9,
        "runtime": {"pid": 1, "version": "0", "policy": "fifo", "started_unix_s": 1e9, "uptime_s": 1.5,
                    "fences": True, "quantum": 1, "closed": False},
        "device": {"platform": "cpu", "kind": "cpu", "id": 0, "name": None, "utilization_percent": None,
                   "memory_used_bytes": None, "memory_total_bytes": None},
        "arena": {**{k: 0 for k in ("capacity_bytes", "committed_bytes", "free_bytes",
                                    "peak_in_flight_bytes", "queued_jobs")}, "capacity_source": "memory=", "queue": []},
        "lanes": [],
        "jobs": [{"name": "a", "id": 0, "status": "running", "paused": False, "lane": 0, "priority": 0,
                  "steps_done": 2, "steps_total": None, "steps_per_s": None, "step_time_p50_s": None,
                  "step_time_p95_s": None, "arrival_s": 0.0, "started_s": None, "ended_s": None,
                  "queue_wait_s": None, "device_time_s": 0.5, "device_time_share": 1.0,
                  "persistent_bytes": 4, "staging_bytes": 0, "ephemeral_bytes": 8, "metrics": None,
                  "error": None, **job}],
    }


# ---------------------------------------------------------------------------------- /metrics

def parse_prometheus(text: str) -> dict[str, Any]:
    """Families by name, read by prometheus_client's own parser (strict: raises on bad text)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert text.endswith("\n")
    families = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in families, f"family {fam.name} twice"
        families[fam.name] = fam
    return families


def samples(fam: Any, suffix: str = "") -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == fam.name + suffix}


def test_metrics_is_prometheus_text_with_the_expected_names(runtime_dir):
    with serving(NAMES) as rt:
        wait_for(lambda: all(j["steps_done"] >= 3 for j in get_status(rt)["jobs"]), what="3 steps each")
        code, headers, body = request(rt.status_server.address, "GET", "/metrics")
        assert code == 200
        assert headers["content-type"].startswith("text/plain; version=")
        text = body.decode()
    families = parse_prometheus(text)
    for name, fam in families.items():
        assert name.startswith("xshare_"), name
        assert fam.documentation, name
    assert "# TYPE xshare_job_steps_total counter" in text  # counters end in _total on the wire
    expected = {"xshare_arena_capacity_bytes": "gauge", "xshare_arena_committed_bytes": "gauge",
                "xshare_arena_free_bytes": "gauge", "xshare_lane_in_use_bytes": "gauge",
                "xshare_job_steps": "counter", "xshare_job_device_seconds": "counter",
                "xshare_job_step_seconds": "histogram", "xshare_job_steps_per_second": "gauge",
                "xshare_job_metric": "gauge", "xshare_runtime_info": "gauge"}
    for name, kind in expected.items():
        assert families[name].type == kind, name
    assert samples(families["xshare_arena_capacity_bytes"]) == {(): 64.0 * 2**20}
    steps = {dict(k)["job_name"]: v for k, v in samples(families["xshare_job_steps"], "_total").items()}
    assert set(steps) == set(NAMES) and all(v >= 3 for v in steps.values())  # ODD survives escaping
    assert "xshare_device_utilization_ratio" not in families  # unknown without NVML: absent
    # Step times as a histogram: cumulative buckets per job, ending in +Inf = the step count seen.
    buckets = {(s.labels["job_name"], s.labels["le"]): s.value
               for s in families["xshare_job_step_seconds"].samples if s.name.endswith("_bucket")}
    assert {n for n, _ in buckets} == set(NAMES)
    for n in NAMES:
        assert buckets[(n, "+Inf")] >= 1
        les = sorted((float(le), v) for (m, le), v in buckets.items() if m == n)
        assert all(a[1] <= b[1] for a, b in zip(les, les[1:]))  # cumulative


def test_prometheus_escapes_labels_and_omits_unknown_values():
    from xshare.runtime.observe.metrics import exposition

    doc = _document(name='a"b\\c\nd', metrics={"loss": float("nan"), "acc": None})
    text = exposition(doc).decode()
    assert 'xshare_job_steps_total{job_name="a\\"b\\\\c\\nd"} 2.0\n' in text
    assert 'xshare_job_metric{job_name="a\\"b\\\\c\\nd",metric="loss"} NaN\n' in text
    assert 'metric="acc"' not in text and "xshare_job_steps_per_second{" not in text
    families = parse_prometheus(text)
    assert samples(families["xshare_job_steps"], "_total") == {(("job_name", 'a"b\\c\nd'),): 2.0}


def test_step_times_are_a_histogram_when_the_document_has_buckets():
    from xshare.runtime.observe.metrics import exposition

    hist = {"bounds_s": [0.001, 0.01], "counts": [3, 1, 2], "sum_s": 0.5, "count": 6}
    fam = parse_prometheus(exposition(_document(step_time_histogram=hist)).decode())["xshare_job_step_seconds"]
    assert fam.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.001": 3.0, "0.01": 4.0, "+Inf": 6.0}  # cumulative
    assert samples(fam, "_count") == {(("job_name", "a"),): 6.0}
    assert samples(fam, "_sum") == {(("job_name", "a"),): 0.5}


# ---------------------------------------------------------------------------------- control

def test_control_needs_the_token_and_pause_resume_priority_cancel_work(runtime_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="xshare")
    with serving(NAMES) as rt:
        srv = rt.status_server
        addr, token = srv.address, srv.token
        wait_for(lambda: steps_of(rt, "alpha") >= 3, what="alpha to step")
        for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                    {"Authorization": f"Basic {token}"}, {"Authorization": "Bearer "}):
            code, headers, body = request(addr, "POST", "/jobs/alpha/pause", headers=bad)
            assert code == 401, (bad, body)
            assert headers["www-authenticate"].startswith("Bearer")
        before = steps_of(rt, "alpha")
        wait_for(lambda: steps_of(rt, "alpha") > before + 3, what="alpha to keep running after 401s")
        assert job_row(get_status(rt), "alpha")["status"] == "running"

        code, _, body = request(addr, "POST", "/jobs/alpha/pause", token=token)
        assert code == 200 and json.loads(body) == {"job": "alpha", "action": "pause", "status": "paused"}
        row = job_row(get_status(rt), "alpha")
        assert row["status"] == "paused" and row["paused"] is True
        held = wait_for(lambda: steady(rt, "alpha"), what="alpha to stop stepping")
        beta = steps_of(rt, "beta")
        wait_for(lambda: steps_of(rt, "beta") > beta, what="beta to keep running while alpha is paused")

        code, _, body = request(addr, "POST", "/jobs/alpha/resume", token=token)
        assert code == 200 and json.loads(body)["status"] == "running"
        wait_for(lambda: steps_of(rt, "alpha") > held, what="alpha to step again after resume")

        code, _, body = request(addr, "POST", "/jobs/beta/priority", json.dumps({"priority": 7}), token=token)
        assert code == 200 and json.loads(body)["priority"] == 7
        assert job_row(get_status(rt), "beta")["priority"] == 7

        # a name with quotes, a slash and a backslash, URL-quoted
        code, _, body = request(addr, "POST", f"/jobs/{quote(ODD, safe='')}/cancel", token=token)
        assert code == 200, body
        wait_for(lambda: job_row(get_status(rt), ODD)["status"] == "cancelled", what="cancel")
        assert job_row(get_status(rt), "alpha")["status"] == "running"
    assert '"POST /jobs/alpha/pause HTTP/1.1" 401' in caplog.text  # requests are logged (debug)...
    assert token not in caplog.text  # ...the token never


# ---------------------------------------------------------------------- binding and discovery

def test_binds_loopback_only_and_announces_itself_in_a_private_file(runtime_dir):
    import psutil

    with serving(("alpha",)) as rt:
        srv = rt.status_server
        host, port = srv.socket.getsockname()[:2]
        assert host == "127.0.0.1" and srv.address == f"127.0.0.1:{port}"
        others = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family == socket.AF_INET and not a.address.startswith("127.")})
        for ip in others:  # the same port on this host's other addresses has nobody listening
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=2).close()
        assert get_status(f"127.0.0.1:{port}")["jobs"][0]["name"] == "alpha"

        path = srv.discovery_path
        assert path.parent == runtime_dir
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        record = json.loads(path.read_text())
        assert record["pid"] == os.getpid() and record["address"] == srv.address
        assert record["token"] == srv.token and record["started"] > 0
        # a file left by a runtime that was killed is ignored
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (runtime_dir / f"{dead.pid}-1.json").write_text(json.dumps(
            {"pid": dead.pid, "address": "127.0.0.1:1", "token": "x", "started": 1.0}))
        (runtime_dir / "garbage.json").write_text("{not json")
        assert [r["address"] for r in discover()] == [srv.address]
    assert not path.exists()  # removed on close
    with pytest.raises(OSError):
        request(f"127.0.0.1:{port}", "GET", "/status", timeout=2)


def test_discovery_directory_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("XSHARE_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert server_mod.discovery_dir() == tmp_path / "xshare"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert server_mod.discovery_dir() == tmp_path / "home" / ".cache" / "xshare" / "runtimes"
    monkeypatch.setenv("XSHARE_RUNTIME_DIR", str(tmp_path / "override"))
    assert server_mod.discovery_dir() == tmp_path / "override"


# -------------------------------------------------------------------------- nonsense requests

def test_nonsense_gets_4xx_and_the_runtime_serves_on_and_finishes_its_jobs(runtime_dir):
    with serving(NAMES, steps=150, delay_s=0.002) as rt:
        rt.pause("alpha")  # hold one job alive through all of this
        addr, token = rt.status_server.address, rt.status_server.token
        huge = b"x" * (MAX_BODY_BYTES + 1)
        cases = [
            ("GET", "/nope", None, None, 404),
            ("GET", "/", None, None, 404),
            ("GET", "/jobs/alpha", None, None, 404),
            ("POST", "/jobs/alpha/explode", None, token, 404),
            ("POST", "/jobs//pause", None, token, 404),
            ("POST", "/status", None, None, 405),
            ("DELETE", "/metrics", None, None, 405),
            ("GET", "/jobs/alpha/pause", None, None, 405),
            ("PUT", "/jobs/alpha/pause", None, token, 405),
            ("BREW", "/status", None, None, 405),
            ("POST", "/jobs/ghost/pause", None, token, 404),
            ("POST", "/jobs/alpha/priority", "{not json", token, 400),
            ("POST", "/jobs/alpha/priority", '{"priority": "high"}', token, 400),
            ("POST", "/jobs/alpha/priority", '{"priority": true}', token, 400),
            ("POST", "/jobs/alpha/priority", "[1]", token, 400),
            ("POST", "/jobs/alpha/priority", None, token, 400),
            ("POST", "/jobs/alpha/pause", "\xff garbage", token, 400),
            ("POST", "/jobs/alpha/pause", huge, token, 413),
            ("POST", "/jobs/alpha/pause", huge, None, 401),  # no token: refused before the size
        ]
        for method, path, body, tok, want in cases:
            headers = None
            if body is huge:
                # Declare the over-long body but send a few bytes of it: the server refuses on
                # the declared length and hangs up without reading, and a client still pushing
                # a whole MiB into that socket would get a reset instead of the reply.
                headers, body = {"Content-Length": str(len(huge))}, huge[:16]
            code, _, reply = request(addr, method, path, body, token=tok, headers=headers)
            assert code == want, (method, path, code, reply[:200])
            assert "error" in json.loads(reply), reply
        # a client that claims a huge body and never sends it is refused at once, not waited for
        code, _, _ = request(addr, "POST", "/jobs/alpha/pause", token=token,
                             headers={"Content-Length": str(10**12)})
        assert code == 413
        # raw garbage and a client that connects and hangs up
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\x00\x01GARBAGE\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.")
        socket.create_connection((host, int(port)), timeout=5).close()
        # HEAD works where GET does
        code, headers, body = request(addr, "HEAD", "/status")
        assert code == 200 and body == b"" and int(headers["content-length"]) > 0

        s = get_status(rt)
        assert job_row(s, "alpha")["status"] == "paused"
        assert status_mod.validate(s) == []
        rt.resume("alpha")
        assert rt.wait(timeout=30)
        s = get_status(rt)
        assert {j["status"] for j in s["jobs"]} == {"done"}
        assert all(j["steps_done"] == 150 for j in s["jobs"])
        assert s["lanes"] == [] and s["arena"]["committed_bytes"] == 0
        # acting on a job that ended is a conflict, not a crash
        code, _, body = request(addr, "POST", "/jobs/alpha/pause", token=token)
        assert code == 409 and "done" in json.loads(body)["error"]


def test_every_control_token_can_be_passed_on_the_command_line():
    # `xshare submit --token TOKEN` (and ctl, top): argparse reads a value that begins with "-"
    # as an option and refuses it ("expected one argument"). 1 in 64 urlsafe-base64 tokens began
    # so, and a benchmark's submit failed on one; 500 tokens all begin otherwise by chance with
    # probability (63/64)**500 < 0.1%.
    import argparse

    from xshare.cli.submit import add_submit_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_submit_arguments(parser)
    for _ in range(500):
        token = server_mod.StatusServer(None).token
        assert parser.parse_args(["--token", token, "pkg:fn"]).token == token
