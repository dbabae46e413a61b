"""Fusion only where it pays: N small CNNs (which lose fused on this CPU) and N MLPs (which win), four ways.

The jobs: ``xshare.models.cnn:make_job`` (a 2-block ResNet, 16 channels, batches of 32) or
``xshare.models.mlp:make_job`` (32-64-64-10, batches of 64), N learning rates x seeds. The ways,
each in a fresh process with a fresh compilation cache (every compile paid, as a first run):

  * pack: ``Runtime(policy="pack")``, unfused;
  * always: ``Runtime(policy="pack", fuse="always")``: every group opens and stays;
  * measured: ``Runtime(policy="pack", fuse=True)`` with nothing known: the group opens, is
    measured once (its solo program compiles in the background), and dissolves if it loses
    (on a CPU a convolving program opens none even unmeasured: ``payoff.unmeasured``);
  * known: the same with the verdict the previous ``measured`` run left (its
    ``fusion-verdicts.json`` copied into the fresh cache): a losing program opens no group.

Clock: from before the Runtime is built to every final state on the host (compiles included).
Reported: the median wall time, the median of per-repeat ratios against pack (> 1: faster than
pack), and the member steps that ran fused.

usage: python -m benchmarks.fusion_payoff [--models cnn,mlp] [--n 6] [--steps 600] [--repeats 3] [--smoke]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("pack", "always", "measured", "known")
LRS = (3e-3, 1e-3, 3e-4)

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import xshare
from xshare.models import {model} as m
n, steps, fuse = {n}, {steps}, {fuse!r}
specs = [m.make_job(lr={lrs}[i % 3], seed=i // 3, steps=steps, name=f"j{{i}}") for i in range(n)]
with xshare.Runtime(policy="pack", fuse=fuse) as rt:
    handles = rt.submit_many(specs)
    rt.wait()
    [h.result() for h in handles]
    fused = rt.snapshot()["runtime"]["fused_member_steps"]
print("RESULT " + json.dumps({{"wall_s": time.perf_counter() - t0, "fused_member_steps": fused}}))
"""


def _run(model: str, n: int, steps: int, way: str, cache: str) -> dict:
    fuse = {"pack": False, "always": "always"}.get(way, True)
    code = CHILD.format(model=model, n=n, steps=steps, fuse=fuse, lrs=LRS)
    env = {**os.environ, "XSHARE_COMPILATION_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{model} {way} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from benchmarks.caches import empty_cache
    from xshare.bench import harness as h

    p = h.parser("fusion_payoff", __doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.n, args.steps, args.repeats = "mlp", 2, 30, 1
    columns = ["model", "N x steps", "way", "e2e s", "speed vs pack (x)", "member steps fused"]
    rows, raw = [], []
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for r in range(args.repeats):
            with contextlib.ExitStack() as stack:
                caches = {w: stack.enter_context(empty_cache(f"payoff-{w}")) for w in WAYS}
                for way in WAYS:  # (in order: "known" takes the verdict "measured" just left)
                    if way == "known":
                        verdicts = Path(caches["measured"]) / "fusion-verdicts.json"
                        if verdicts.exists():
                            shutil.copy(verdicts, caches["known"])
                    runs[way].append(_run(model, args.n, args.steps, way, caches[way]))
                    print(f"  {model} repeat {r + 1}/{args.repeats} {way}: {runs[way][-1]['wall_s']:.2f} s, "
                          f"{runs[way][-1]['fused_member_steps']} fused", flush=True)
        raw.append({"model": model, "runs": runs})
        for way in WAYS:
            ratios = h.paired_ratios([x["wall_s"] for x in runs["pack"]], [x["wall_s"] for x in runs[way]])
            rows.append([model, f"{args.n} x {args.steps}", way, h.median(x["wall_s"] for x in runs[way]),
                         h.median(ratios), h.median(x["fused_member_steps"] for x in runs[way])])
        print(h.markdown_table(columns, [r for r in rows if r[0] == model]), flush=True)
    h.write_results("fusion_payoff", args.out, title="Fusion only where it pays: pack, always, measured, known",
                    columns=columns, rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"models": args.models, "n": args.n, "steps": args.steps, "repeats": args.repeats},
                    data={"runs": raw}, notes=__doc__.split("\n\n", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
