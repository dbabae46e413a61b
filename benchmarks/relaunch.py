"""Relaunch: the same sweep launched twice; the second finds its programs in XLA's persistent
compilation cache (which ``xshare launch`` turns on) and should spend a small fraction of the
first launch's compile time.

usage: python benchmarks/relaunch.py [--spec examples/sweep.toml] [--repeats 3]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"xla: (\d+) program\(s\) compiled in ([0-9.]+) s")


def _launch(spec: str, cache: str, out: str) -> tuple[int, float]:
    env = dict(os.environ, XSHARE_COMPILATION_CACHE=cache)
    proc = subprocess.run([sys.executable, "-m", "xshare", "launch", spec, "--out", out],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    found = LINE.search(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return int(found.group(1)), float(found.group(2))


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from xshare.bench import harness as h

    p = h.parser("relaunch", __doc__.splitlines()[0])
    p.add_argument("--spec", default="examples/sweep.toml")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows, raw = [], []
    for _ in range(1 if args.smoke else args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            first = _launch(args.spec, f"{tmp}/cache", f"{tmp}/run1")
            second = _launch(args.spec, f"{tmp}/cache", f"{tmp}/run2")
        raw.append({"first": first, "second": second})
    f = h.median(x["first"][1] for x in raw)
    s = h.median(x["second"][1] for x in raw)
    rows.append([args.spec, raw[0]["first"][0], f, s, f"{100 * s / f:.1f}%" if f else "n/a"])
    h.write_results("relaunch", args.out, title="Relaunch: XLA compile time, first launch vs relaunch",
                    columns=["spec", "programs", "first launch compile s", "relaunch compile s", "relaunch / first"],
                    rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"spec": args.spec, "repeats": args.repeats}, data={"runs": raw},
                    notes="Compile seconds as `xshare launch` reports them (time inside XLA compile "
                          "calls; a persistent-cache hit loads the executable instead). Medians.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
