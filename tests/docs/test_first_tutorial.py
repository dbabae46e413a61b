"""The first tutorial, followed exactly as a newcomer would: its blocks copied in order into a
fresh empty directory (the files saved, the Python pasted into one session, the commands typed
into a shell, `xshare top` in a second terminal beside the long launch), checking that the reader
sees what the page says they see."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs import blocks

PAGE = blocks.REPO / "docs" / "tutorials" / "first-shared-device.md"


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "XSHARE_RUNTIME_DIR": str(tmp / "runtimes"),
            "XSHARE_COMPILATION_CACHE": str(tmp / "xla-cache"),
            "COLUMNS": "160"}  # rich tables wide enough that job names are not cut


def _shell(code: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout + proc.stderr


def _says(text: str) -> None:
    """What the test checks must be what the page tells the reader."""
    assert text in PAGE.read_text(encoding="utf-8"), f"the tutorial no longer says {text!r}"


def test_first_tutorial_as_a_newcomer_follows_it(tmp_path):
    page = blocks.parse(PAGE)
    env = _env(tmp_path)
    work = tmp_path / "tutorial"
    work.mkdir()  # "Work in an empty directory."

    # 1. the saved files, as the page captions name them
    files = {b.title: b for b in page if b.kind == "file"}
    assert set(files) == {"linreg.py", "sweep.toml"}
    for name, b in files.items():
        (work / name).write_text(b.code, encoding="utf-8")

    # 2. the Python blocks, pasted in order into one session (one interpreter)
    session = "".join(b.code for b in page if b.kind == "python")
    proc = subprocess.run([sys.executable, "-"], input=session, cwd=work, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    _says("XLA compiles: 1")
    assert "XLA compiles: 1" in out.splitlines()
    for name in ("linreg-lr0.01-s0", "linreg-lr0.01-s1", "linreg-lr0.05-s0", "linreg-lr0.05-s1"):
        _says(f"{name} done loss")
        assert any(line.startswith(f"{name} done loss") for line in out.splitlines()), out

    # 3. the commands, in order, as typed (the long launch and top come next, in two terminals)
    shell = [b for b in page if b.kind == "bash"]
    runnable = [b for b in shell if not b.skip]
    dry, launch, look = (_shell(b.code, work, env) for b in runnable)
    for name in ("0_lr=0.01,seed=0", "1_lr=0.01,seed=1", "2_lr=0.05,seed=0", "3_lr=0.05,seed=1"):
        _says(f"│ {name} │")
        assert name in dry and name in launch
    _says("4 job(s) in 0.6s: 4 done")
    assert "4 done" in launch
    _says("xla: 1 program(s) compiled")
    assert "xla: 1 program(s) compiled" in launch
    _says("checkpoint  events.out.tfevents")
    assert {"checkpoint", "log.txt", "metrics.jsonl"} <= set(look.split())
    assert any(name.startswith("events.out.tfevents.") for name in look.split())  # (the test extra has tensorboardX)
    assert '{"step": 0, "time_s": ' in look and '{"step": 1, ' in look

    # 4. the long launch in one terminal, `xshare top` in a second
    long_launch, top = [b for b in shell if b.skip]
    assert "--steps 200000" in long_launch.code and top.code.strip() == "xshare top"
    runner = subprocess.Popen(["bash", "-c", "exec " + long_launch.code.strip()], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        screen, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline:
            # off a terminal `xshare top` prints one screen, like --once (the page says so)
            shot = subprocess.run(["xshare", "top"], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=60)
            screen = shot.stdout
            if shot.returncode == 0 and "running" in screen and "0_lr=0.01,seed=0" in screen:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"xshare top never showed the running jobs:\n{screen}\n{shot.stderr}")
        for text in ("Device cpu:0", "Arena", "of 1.0 GiB (memory argument)", "Lanes", "Jobs"):
            _says(text)
            assert text in screen, screen
        runner.send_signal(signal.SIGINT)  # "Press Ctrl-C in the first terminal"
        out, _ = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    _says("exits with code 130")
    assert runner.returncode == 130, out[-2000:]
    _says("the jobs `cancelled`")
    assert "cancelled" in out
    # (Orbax's layout: one directory per checkpointed step)
    assert any((work / "runs" / "long" / "0_lr=0.01,seed=0" / "checkpoint").iterdir())
