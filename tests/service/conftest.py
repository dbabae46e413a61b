"""A real ``xshare serve`` in a subprocess, with its own discovery dir and run dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = {"width": 16, "batch": 8}  # a tiny MLP: compiles in a second, steps in microseconds


def env_for(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(XSHARE_RUNTIME_DIR=str(tmp / "discovery"), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    env.pop("XSHARE_TOKEN", None)
    return env


class Served:
    def __init__(self, tmp: Path, *extra: str, memory: str = "256MiB"):
        self.tmp, self.run_dir, self.env = tmp, tmp / "run", env_for(tmp)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xshare", "serve", "--run-dir", str(self.run_dir), "--memory", memory,
             "--checkpoint-every", "50", *extra],
            env=self.env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        announce = self.run_dir / "service.json"
        deadline = time.monotonic() + 90
        while not announce.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out, err = self.proc.communicate(timeout=10) if self.proc.poll() is not None else ("", "")
                self.stop()
                raise AssertionError(f"xshare serve did not start: rc={self.proc.returncode}\n{out}\n{err}")
            time.sleep(0.1)
        rec = json.loads(announce.read_text())
        self.address, self.token = rec["address"], rec["token"]
        assert (announce.stat().st_mode & 0o777) == 0o600

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "xshare", *args], env=self.env, cwd=self.tmp,
                              capture_output=True, text=True, timeout=timeout)

    def http(self, method: str, path: str, body: bytes | None = None, token: str | None = "default",
             ) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        token = self.token if token == "default" else token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"http://{self.address}{path}", data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def jobs(self) -> dict[str, dict]:
        code, doc = self.http("GET", "/jobs", token=None)
        assert code == 200, doc
        return {j["name"]: j for j in doc["jobs"]}

    def wait_for(self, predicate, timeout: float = 120, what: str = "condition") -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs()
            if predicate(jobs):
                return jobs
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {jobs}")
            time.sleep(0.2)

    def terminate(self, timeout: float = 120) -> tuple[int, str, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()
