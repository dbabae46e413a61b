"""``xshare top`` against real runtimes: JSON and NDJSON output, discovery, the one-shot
rendering, and the live view driven in a real terminal (tmux): keys select, pause and quit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

import xshare
from xshare.cli.main import main
from xshare.cli.top import KeyReader
from xshare.runtime.observe import schema as status_mod

from tests.status import REPO, ODD, job_row, runtime_dir, serving, wait_for  # noqa: F401

NAMES = ("alpha", "beta", ODD)


def xshare_top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m xshare top ...`` in a subprocess (stdout is a pipe, not a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "xshare", "top", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def test_json_once_names_every_job_by_address_and_by_discovery(runtime_dir):
    with serving(NAMES) as rt:
        wait_for(lambda: all(j.progress().steps_done > 0 for j in rt.jobs), what="every job to step")
        by_address = xshare_top("--once", "--json", "--address", rt.status_server.address)
        assert by_address.returncode == 0, by_address.stderr
        s = json.loads(by_address.stdout)
        assert status_mod.validate(s) == []
        assert sorted(j["name"] for j in s["jobs"]) == sorted(NAMES)

        discovered = xshare_top("--json")  # no --address: the discovery file
        assert discovered.returncode == 0, discovered.stderr
        s = json.loads(discovered.stdout)
        assert s["runtime"]["pid"] == os.getpid()
        assert sorted(j["name"] for j in s["jobs"]) == sorted(NAMES)


def test_several_runtimes_and_ndjson(runtime_dir, capsys):
    with serving(("alpha",)) as rt, xshare.Runtime(memory="1MiB", status_port=0) as idle:
        assert main(["top", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [len(r["jobs"]) for r in doc["runtimes"]] == [1, 0]  # oldest first
        for r in doc["runtimes"]:
            assert status_mod.validate(r) == []

        assert main(["top", "--json", "--interval", "0.05", "-n", "3", "--address", rt.status_server.address]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 3
        steps = [job_row(json.loads(line), "alpha")["steps_done"] for line in lines]
        assert steps == sorted(steps)
        assert idle.status_server.address != rt.status_server.address


def test_once_renders_device_arena_lanes_and_jobs(runtime_dir, capsys, monkeypatch):
    with serving(NAMES) as rt:
        rt.pause("beta")
        wait_for(lambda: rt.handle("alpha").progress().steps_done > 0, what="alpha to step")
        monkeypatch.setenv("COLUMNS", "160")
        assert main(["top", "-1"]) == 0
        wide = capsys.readouterr().out
        monkeypatch.setenv("COLUMNS", "80")
        assert main(["top"]) == 0  # pytest's stdout is not a terminal: once, like --once
        narrow = capsys.readouterr().out
    for out, width in ((wide, 160), (narrow, 80)):
        assert "Device cpu:0 (cpu)  util N/A  mem N/A" in out
        assert "Arena" in out and "64.0 MiB" in out and "Lanes" in out and "Jobs (sorted by id)" in out
        for name in NAMES:
            assert name in out, out  # whole, not cut to fit
        assert "paused" in out and "running" in out
        assert max(len(line) for line in out.splitlines()) <= width
    assert "p95" in wide and "p95" not in narrow  # narrow terminals drop the less vital columns


def test_no_runtime_is_a_clear_error(runtime_dir, capsys):
    assert main(["top", "--once"]) == 1
    assert "no running xshare runtime found in" in capsys.readouterr().err
    assert main(["top", "--json", "--address", "127.0.0.1:1"]) == 1
    assert "no runtime at 127.0.0.1:1" in capsys.readouterr().err


def test_key_parsing():
    assert KeyReader.parse(b"\x1b[Aq") == ["up", "q"]
    assert KeyReader.parse(b"\x1b[B\x1bOBjkP") == ["down", "down", "down", "up", "p"]
    assert KeyReader.parse(b"\x1b[1;5Cs") == ["s"]  # an unknown sequence (ctrl-right) is skipped


# --------------------------------------------------------------------------------- live view

class Tmux:
    """One private tmux server (its own socket), killed at the end: other sessions are untouched."""

    def __init__(self):
        self.socket = f"xshare-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_a_terminal(runtime_dir, tmp_path):
    rc_file = tmp_path / "rc"
    tmux = Tmux()
    with serving(NAMES) as rt:
        # (pytest exports COLUMNS=80 and LINES=24, which rich would prefer to the pane's size)
        command = (f"cd {REPO} && env -u COLUMNS -u LINES XSHARE_RUNTIME_DIR={runtime_dir} "
                   f"PYTHONPATH={REPO} JAX_PLATFORMS=cpu "
                   f"{sys.executable} -m xshare top --interval 0.3; echo $? > {rc_file}")
        try:
            tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "50", command)
            # "q quit" is drawn last: once it is there the screen is whole
            screen = wait_for(lambda: (lambda s: s if "q quit" in s else None)(tmux.screen()),
                              timeout=30, what="the live view to draw")
            for title in ("Device cpu:0", "Arena", "Lanes", "Jobs (sorted by id)", "q quit"):
                assert title in screen, screen
            for name in NAMES:
                assert name in screen, screen
            assert "▶" in screen  # the first job is selected

            tmux("send-keys", "-t", "top", "Down", "p")  # select beta, pause it
            wait_for(lambda: rt.handle("beta").status() == "paused", what="p to pause beta")
            assert rt.handle("alpha").status() == "running"
            wait_for(lambda: "paused beta" in tmux.screen(), what="the message line")
            tmux("send-keys", "-t", "top", "p")  # and resume it
            wait_for(lambda: rt.handle("beta").status() == "running", what="p to resume beta")

            tmux("send-keys", "-t", "top", "s")
            wait_for(lambda: "Jobs (sorted by name)" in tmux.screen(), what="s to change the sort key")

            tmux("send-keys", "-t", "top", "q")
            wait_for(rc_file.exists, timeout=10, what="q to quit")
            time.sleep(0.1)
            assert rc_file.read_text().strip() == "0"
        finally:
            tmux.close()
