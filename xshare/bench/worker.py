"""``python -m xshare.bench.worker COMMAND JSON``: the benchmark's measured processes.

Each measurement runs in a fresh process, so its memory is its own (the parent samples the
RSS of that process tree) and no mode inherits another's warm caches or compiled executables.

Commands (JSON argument in, one result line out):

* ``mode``      ``{"mode": "exclusive" | "threads" | "xshare:<policy>", "jobs": [...]}``
* ``job``       ``{"job": {...}}``: one job of the ``processes`` mode. Prints ``ready`` once
  compiled, then waits for a line on stdin (the start barrier) before running.
* ``overhead``  ``{"job": {...}, "pairs": N}``
* ``calibrate`` ``{"n": 2048, "repeats": 5}``: the device's peak FLOP/s (a large f32 matmul,
  best of ``repeats``) and what the device and jax are.

Protocol: lines starting with ``MARK`` on stdout carry JSON (``{"event": ...}``); anything
else a library prints is ignored. Exit status 0, or 1 with an ``error`` event.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

MARK = "@@xshare-bench "


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(MARK + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def calibrate(n: int = 2048, repeats: int = 5) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import jaxlib

    from .loop import flops_of

    dev = jax.devices()[0]
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32)
    compiled = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
    flops = flops_of(compiled) or 2.0 * n ** 3
    compiled(a, b).block_until_ready()  # burn-in
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled(a, b).block_until_ready()  # a sync point: the clock reads after the device is done
        times.append(time.perf_counter() - t)
    return {"peak_flops_per_s": flops / min(times), "matmul_n": n, "matmul_flops": flops,
            "matmul_s": times, "method": f"f32 matmul {n}x{n} @ {n}x{n}, best of {repeats} (after 1 burn-in)",
            "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
            "platform": dev.platform, "device_kind": getattr(dev, "device_kind", dev.platform),
            "device_count": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    command, raw = argv[0], json.loads(argv[1])
    try:
        from . import modes
        from .workloads import JobPlan

        if command == "calibrate":
            emit("result", result=calibrate(raw.get("n", 2048), raw.get("repeats", 5)))
        elif command == "mode":
            plans = [JobPlan.from_json(j) for j in raw["jobs"]]
            mode = raw["mode"]
            kind, policy, kwargs = modes.mode_spec(mode)
            if kind == "exclusive":
                result = modes.run_exclusive(plans)
            elif kind == "threads":
                result = modes.run_threads(plans)
            elif kind == "xshare":
                result = modes.run_xshare(plans, policy, runtime_kwargs=kwargs)
            else:
                raise ValueError(f"worker: mode {mode!r} does not run in one process")
            emit("result", result=result)
        elif command == "job":
            plan = JobPlan.from_json(raw["job"])
            result = modes.run_worker(plan, ready=lambda: emit("ready"), go=sys.stdin.readline)
            emit("result", result=result)
        elif command == "overhead":
            emit("result", result=modes.run_overhead(JobPlan.from_json(raw["job"]), int(raw["pairs"])))
        else:
            raise ValueError(f"worker: unknown command {command!r}")
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        emit("error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
