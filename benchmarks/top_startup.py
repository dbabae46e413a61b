"""``xshare top --once`` startup: wall time from starting the command to its exit (first and
only frame drawn), against a running ``xshare launch``. Target: under 0.5 s.

A launch of examples/sweep.toml (more steps, so it outlives the measurement) runs in the
background with its status server on a known port; once its jobs step, ``xshare top --once
--address`` is timed with :func:`xshare.bench.harness.time_command` (one burn-in, then
``--repeats`` runs), and ``python -c pass`` beside it for the interpreter's own start.

    python -m benchmarks.top_startup [--smoke] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from xshare.bench import harness as H

NAME = "top_startup"
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(address: str) -> int:
    with urllib.request.urlopen(f"http://{address}/status", timeout=2) as resp:
        return sum(j["steps_done"] for j in json.loads(resp.read())["jobs"])


def main(argv: list[str] | None = None) -> int:
    p = H.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each command (default 10; 2 smoke)")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.smoke else 10)
    info = H.machine(device=False)  # the parent never imports jax: the launch owns the device
    port = _free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="xshare-top-") as tmp:
        env = {**os.environ, "XSHARE_RUNTIME_DIR": tmp}
        launch = subprocess.Popen([sys.executable, "-m", "xshare", "launch", "examples/sweep.toml", "--steps", "100000",
                                   "--status-port", str(port), "--out", str(Path(tmp) / "run")],
                                  cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            while True:  # until its jobs step (compiled, running)
                try:
                    if _steps(address) > 0:
                        break
                except OSError:
                    pass
                if launch.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the launch did not start stepping: {launch.stderr.read()[-2000:]}")
                time.sleep(0.2)
            runs = H.alternate({
                "python -c pass": lambda: H.time_command([sys.executable, "-c", "pass"], 1, cwd=REPO, env=env),
                "xshare top --once": lambda: H.time_command(
                    [sys.executable, "-m", "xshare", "top", "--once", "--address", address], 1, cwd=REPO, env=env),
                "xshare top --once --json": lambda: H.time_command(
                    [sys.executable, "-m", "xshare", "top", "--once", "--json", "--address", address], 1, cwd=REPO,
                    env=env),
            }, repeats, log=None)
            still_running = _steps(address) > 0 and launch.poll() is None
        finally:
            launch.terminate()
            launch.wait(timeout=120)
    columns = ["command", "median s", "p90 s", "min s", "max s", "n"]
    rows, data = [], {}
    for name, rs in runs.items():
        s = H.summary(t for r in rs for t in r["times_s"])
        data[name] = s
        rows.append([name, s["median"], s["p90"], s["min"], s["max"], s["n"]])
    top = data["xshare top --once"]["median"]
    notes = f"""
## What is measured

Wall seconds from spawning the command to its exit, measured by the parent
(`xshare.bench.harness.time_command`), against a running `xshare launch examples/sweep.toml
--steps 100000` (4 MLP jobs stepping on the same {info['cores']} cores, which slows every
command here). Commands alternate, one burn-in each, {repeats} timed runs each. `xshare top`
renders one frame from `GET /status` and exits; it imports no jax (tests/test_imports.py).
The launch was still running at the end: {still_running}.

Target: `xshare top --once` under 0.5 s: **{'met' if top < 0.5 else 'NOT met'}** (median {H.fmt(top)} s).
"""
    H.write_results(NAME, args.out, title="xshare top --once startup against a running launch", columns=columns,
                    rows=rows, machine_info=info, config={"repeats": repeats, "address": address},
                    data={"summary": data, "launch_still_running": still_running}, notes=notes, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
