"""``xshare doctor --selftest``: every device path once, checked, with its figures.

Each check runs what a user runs (a ``Runtime``, the zoo models, ``rt.deploy``) and compares it
with plain JAX: fences executed on the device, ``memory_analysis()`` against measured peaks,
preallocation and the arena's figures, a fused sweep, a served model, bit-equivalence with a
plain jit loop, and a short throughput figure against that loop. Figures a backend does not
have (``memory_stats()`` and NVML on a CPU) are N/A, never invented. A check that raises is a
failed check with the exception's text; the others still run.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .._units import format_bytes
from .doctor_checks import FAIL, INFO, NA, OK, WARN


# One MLP shape for every check that needs a job: the runtime's program cache and jax's jit
# cache then compile each program once for all of them (compiles dominate on a small CPU).
WIDTH = 64


@dataclass
class Result:
    name: str
    status: str
    summary: str
    fix: str | None = None
    figures: dict = field(default_factory=dict)


def _plain_loop(spec: Any, steps: int) -> Any:
    """The reference: the job's step, jitted with donation, in a plain Python loop."""
    import jax
    import jax.numpy as jnp

    state = jax.tree.map(lambda x: jnp.array(x, copy=True), spec.state)
    step = jax.jit(spec.fn, donate_argnums=(0,))
    for k in range(steps):
        state, metrics = step(state, spec.data(k))
    jax.block_until_ready(state)
    return state


def _max_diff(a: Any, b: Any) -> float:
    import jax
    import numpy as np

    return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)), default=0.0)


def _identical(a: Any, b: Any) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _run_jobs(specs: list, **kwargs: Any) -> tuple[list, Any, float]:
    import xshare

    t0 = time.perf_counter()
    with xshare.Runtime(memory=kwargs.pop("memory", "1GiB"), **kwargs) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        timeline = rt.timeline()
        fences = rt.fences
    bad = [f"{h.name}: {h.status()} {h.error or ''}" for h in handles if h.status() != "done"]
    if bad:
        raise RuntimeError("jobs did not finish: " + "; ".join(bad))
    return handles, (timeline, fences), time.perf_counter() - t0


def check_fences(quick: bool) -> Result:
    import jax

    from .. import ffi
    from ..ffi import canary

    if not ffi.enabled():
        return Result("fences", NA, f"no fences here: {ffi.unavailable_reason() or 'XSHARE_FFI=0'}")
    ok, verdict = canary.gate(jax.devices()[0])
    if not ok:
        assert verdict is not None  # gate() gives no verdict only under XSHARE_CANARY=skip, which passes
        return Result("fences", FAIL, f"not run: the canary failed ({verdict.reason})",
                      "see the canary row; runtimes here run without fences")
    # The canary's per-step check, in this process now that a child has survived it (the
    # quick subset relies on the child's verdict for it).
    reason = f"canary passed on {jax.devices()[0].device_kind}"
    if not quick:
        passed, reason = canary.run_canary(jax.default_backend(), steps=8)
        if not passed:
            return Result("fences", FAIL, reason, "report it with `xshare doctor --json`")
    from xshare.models import mlp  # type: ignore[import-not-found]  # models/ installs as xshare.models (package-dir); mypy sees xshare/ only

    steps = 20
    start = ffi.now_ns()
    handles, (timeline, fenced), _ = _run_jobs([mlp.make_job(width=WIDTH, steps=steps, name="fenced")])
    end = ffi.now_ns()
    if not fenced:
        return Result("fences", FAIL, "the runtime ran without fences although the canary passed")
    rows = sorted((r for r in timeline if r.job == handles[0].id), key=lambda r: r.step)
    slack = canary.CLOCK_SLACK_NS.get(jax.default_backend(), 100_000)
    problems = []
    if [r.step for r in rows] != list(range(steps)):
        problems.append(f"steps recorded {[r.step for r in rows]}, expected 0..{steps - 1} once each")
    if any(not start - slack <= r.t_begin_ns <= r.t_end_ns <= end + slack for r in rows):
        problems.append("a step's device times lie outside the run's wall time")
    if any(b.t_begin_ns < a.t_end_ns - slack for a, b in zip(rows, rows[1:])):
        problems.append("a step began before the previous one ended")
    device_s = sum(r.t_end_ns - r.t_begin_ns for r in rows) / 1e9
    figures = {"steps": len(rows), "device_time_s": round(device_s, 6), "wall_s": round((end - start) / 1e9, 3)}
    if problems:
        return Result("fences", FAIL, "; ".join(problems), "report it with `xshare doctor --json`", figures)
    here = " (8 fenced steps checked in this process)" if not quick else " (the child's verdict)"
    return Result("fences", OK, f"{reason.split(':')[0]}{here}; runtime timeline: {steps} steps, one "
                  f"record each, monotone, inside the run ({device_s * 1e3:.1f} ms of device time)",
                  figures=figures)


def check_memory(quick: bool) -> Result:
    """memory_analysis() of each zoo model's donated step against its measured peak."""
    import jax

    from xshare.models import cnn, mlp, transformer

    from ..memory.footprint import footprint_from_analysis
    from ..memory.plausible import above_measured
    from ..runtime.compiled.program import tree_nbytes

    device = jax.devices()[0]
    zoo = [("mlp", lambda: mlp.make_job(width=WIDTH if quick else 128, steps=3))]
    if not quick:
        zoo += [("cnn", lambda: cnn.make_job(channels=8, blocks=1, batch=8, steps=3)),
                ("transformer", lambda: transformer.make_job(d_model=32, layers=1, seq=32, batch=8, steps=3))]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    worst = OK
    for name, make in zoo:
        spec = make()
        state = jax.device_put(spec.state, device)
        batch = jax.device_put(spec.data(0), device)
        compiled = jax.jit(spec.fn, donate_argnums=(0,)).lower(state, batch).compile()
        fp = footprint_from_analysis(compiled.memory_analysis(), state_bytes=tree_nbytes(state),
                                     batch_bytes=tree_nbytes(batch), prefetch=0, job=name,
                                     hlo=compiled.as_text)
        before = _stats(device)
        measured = None
        if before is not None:
            for _ in range(3):
                state, metrics = compiled(state, batch)
                batch = jax.device_put(spec.data(1), device)
            jax.block_until_ready((state, metrics))
            after = _stats(device)
            # Bytes above what was in use before the steps (the state and one batch): the
            # step's temporaries and outputs, E's share. peak_bytes_in_use only rises, so a
            # peak set by an earlier model hides this one's: then it is not measured.
            if after is not None and after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
                measured = after["peak_bytes_in_use"] - before["bytes_in_use"]
        # The allocator rounds each buffer up (BFC: 256 B chunks, whole regions): only a
        # measured peak beyond 5% + 1 MiB of the prediction is reported as above it.
        over = (above_measured(fp.ephemeral, measured)
                if measured is not None and measured > fp.ephemeral * 1.05 + (1 << 20) else None)
        status = WARN if (fp.note or over) else OK
        worst = WARN if status == WARN else worst
        notes += [n for n in (fp.note, over and over[1]) if n]
        rows.append({"model": name, "persistent_bytes": fp.persistent, "ephemeral_bytes": fp.ephemeral,
                     "temp_bytes": fp.temp, "measured_bytes": measured, "status": status,
                     "note": fp.note or (over[1] if over else None)})
    summary = "; ".join(f"{r['model']}: P {format_bytes(r['persistent_bytes'])}, E "
                        f"{format_bytes(r['ephemeral_bytes'])}, measured "
                        f"{format_bytes(r['measured_bytes']) if r['measured_bytes'] is not None else 'N/A'}"
                        for r in rows)
    if before is None:
        summary += " (no memory_stats() on this backend: peaks N/A)"
    elif any(r["measured_bytes"] is None for r in rows):
        # peak_bytes_in_use has no reset, and on a GPU the compile's autotuning scratch sets a
        # peak these small steps never reach (an H100, 2026-11-26: all three N/A).
        summary += (" (N/A: the device's peak_bytes_in_use was already above what these steps reach, "
                    "set by an earlier allocation such as the compile's autotuning scratch)")
    return Result("memory_analysis vs peaks", worst, summary,
                  "; ".join(notes) + " (admission charges the safe bound)" if notes else None,
                  {"models": rows})


def _stats(device: Any) -> dict | None:
    try:
        s = device.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return s if s and "peak_bytes_in_use" in s else None


def check_arena(quick: bool) -> Result:
    import jax

    import xshare

    from ..memory.device import preallocation_settings

    device = jax.devices()[0]
    with xshare.Runtime() as rt:
        capacity, source = rt.arena.capacity, rt.capacity_source
    stats = _stats(device)
    figures = {"arena_bytes": capacity, "arena_source": source,
               "bytes_limit": stats.get("bytes_limit") if stats else None}
    if stats is None or not stats.get("bytes_limit"):
        return Result("preallocation and arena", OK if device.platform == "cpu" else WARN,
                      f"arena {format_bytes(capacity)} ({source}); preallocation N/A on {device.platform}",
                      None if device.platform == "cpu" else "no bytes_limit: pass Runtime(memory=...)", figures)
    settings = {s["name"]: s for s in preallocation_settings()}
    fraction = float(settings["XLA_CLIENT_MEM_FRACTION"]["value"])
    from ..runtime.observe.nvml import LIBRARY, nvml_index

    index = nvml_index(device)
    nv = LIBRARY.query(index) if index is not None else None
    figures.update({"fraction": fraction, "nvml_total_bytes": nv.memory_total_bytes if nv else None,
                    "nvml_used_bytes": nv.memory_used_bytes if nv else None})
    problems = []
    if capacity != stats["bytes_limit"]:
        problems.append(f"arena {capacity} B != bytes_limit {stats['bytes_limit']} B")
    if nv and nv.memory_total_bytes:
        want = fraction * nv.memory_total_bytes
        if abs(stats["bytes_limit"] - want) > 0.05 * want:
            problems.append(f"bytes_limit {format_bytes(stats['bytes_limit'])} is not {fraction:g} of "
                            f"{format_bytes(nv.memory_total_bytes)}")
        preallocated = settings["XLA_PYTHON_CLIENT_PREALLOCATE"]["value"].lower() not in ("false", "0")
        if preallocated and (nv.memory_used_bytes or 0) < 0.95 * stats["bytes_limit"]:
            problems.append(f"NVML shows {format_bytes(nv.memory_used_bytes)} used: the pool of "
                            f"{format_bytes(stats['bytes_limit'])} was not preallocated")
    summary = (f"arena {format_bytes(capacity)} ({source}); bytes_limit {format_bytes(stats['bytes_limit'])}, "
               f"fraction {fraction:g}" + (f", NVML {format_bytes(nv.memory_used_bytes)} / "
                                           f"{format_bytes(nv.memory_total_bytes)} used" if nv and nv.name else ""))
    if problems:
        return Result("preallocation and arena", FAIL, summary + ": " + "; ".join(problems),
                      "check XLA_PYTHON_CLIENT_PREALLOCATE / XLA_CLIENT_MEM_FRACTION (xshare doctor's allocator rows)",
                      figures)
    return Result("preallocation and arena", OK, summary, figures=figures)


def check_equivalence(quick: bool) -> Result:
    from xshare.models import mlp

    steps = 20 if quick else 40
    spec = mlp.make_job(width=WIDTH, steps=steps, name="equiv")
    handles, _, _ = _run_jobs([spec], policy="pack")
    got, want = handles[0].result()[0], _plain_loop(mlp.make_job(width=WIDTH, steps=steps), steps)
    if _identical(got, want):
        return Result("equivalence", OK, f"mlp, {steps} steps under the runtime: bit-identical to a plain jit loop")
    diff = _max_diff(got, want)
    import jax

    if jax.default_backend() != "cpu" and diff <= 1e-5:
        # XLA's GPU reductions may use atomics: two runs of one program can differ in the last bits.
        return Result("equivalence", WARN, f"mlp, {steps} steps: not bit-identical to a plain jit loop "
                      f"(max |diff| {diff:.3g}); XLA's GPU reductions need not be deterministic",
                      "XLA_FLAGS=--xla_gpu_deterministic_ops=true makes them bit-identical",
                      {"max_abs_diff": diff})
    return Result("equivalence", FAIL, f"mlp, {steps} steps: differs from a plain jit loop (max |diff| {diff:.3g})",
                  "report it with the --report file", {"max_abs_diff": diff})


def check_fused(quick: bool) -> Result:
    from xshare.models import mlp

    import jax

    steps, lrs = (15, (1e-3, 3e-3)) if quick else (30, (1e-3, 2e-3, 3e-3, 5e-3))
    make = lambda lr, name=None: mlp.make_job(lr=lr, width=WIDTH, steps=steps, name=name)  # noqa: E731
    # On an H100 (2026-11-26) the fused members ended 0.002 from their solo loops: on a GPU,
    # float32 matmuls run in TF32 by default (10 mantissa bits) and the batched program takes
    # other kernels than the solo one, and Adam turns rounding noise in near-zero gradients
    # into steps of the learning rate's size. The check is of the fusion, not of TF32, so on
    # a GPU both sides run in full float32 ("highest"; a config value, not a context manager,
    # because the runtime traces on its own threads). Not yet run on a GPU in this form.
    precision = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # jax sets its options on Config at import (setattr)
    full = jax.default_backend() != "cpu"
    if full:
        jax.config.update("jax_default_matmul_precision", "highest")
    try:
        handles, _, wall = _run_jobs([make(lr, f"fused-{i}") for i, lr in enumerate(lrs)], fuse=True)
        diff = max(_max_diff(h.result()[0], _plain_loop(make(lr), steps)) for h, lr in zip(handles, lrs))
    finally:
        if full:
            jax.config.update("jax_default_matmul_precision", precision)
    figures = {"members": len(lrs), "steps": steps, "wall_s": round(wall, 3), "max_abs_diff_vs_unfused": diff,
               "matmul_precision": "highest" if full else "default"}
    # vmap may reorder reductions: close to the unfused loop, not bit-identical (DESIGN.md).
    status = OK if diff < 1e-4 else FAIL
    where = " (float32 matmuls at 'highest', not TF32)" if full else ""
    return Result("fused sweep", status, f"{len(lrs)} mlp jobs x {steps} steps fused, all done in {wall:.1f} s; "
                  f"max |diff| to each unfused plain loop {diff:.2g}{where}", None if status == OK else
                  "fused members drift from their unfused jobs beyond 1e-4: report it", figures)


def check_serving(quick: bool) -> Result:
    import jax
    import numpy as np

    import xshare
    from xshare.models import inference

    spec = inference.make_model("mlp", max_batch=8, max_delay_ms=1.0, name="selftest")
    x = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
    with xshare.Runtime(memory="1GiB") as rt:
        m = rt.deploy(spec)
        t0 = time.perf_counter()
        out = m.infer({"x": x})
        latency = time.perf_counter() - t0
        rt.undeploy("selftest")
    want = jax.jit(spec.predict)(spec.params, {"x": x})
    diff = _max_diff(out["probs"], want["probs"])
    same_labels = bool(np.array_equal(out["label"], np.asarray(want["label"])))
    ok = same_labels and diff < 1e-5
    return Result("served model", OK if ok else FAIL,
                  f"mlp deployed, 5 rows answered in {latency * 1e3:.1f} ms; labels "
                  f"{'equal' if same_labels else 'DIFFER'}, max |diff| of probs {diff:.2g} vs jit(predict)",
                  None if ok else "served answers differ from predict(): report it",
                  {"latency_ms": round(latency * 1e3, 2), "max_abs_diff": diff})


def check_throughput(quick: bool) -> Result:
    """Steps/s of one job under the runtime against the same job's plain loop, alternated
    (burn-in first), medians: absolute times drift on a shared machine, ratios less."""
    import xshare
    from xshare.models import mlp

    steps, rounds = (100, 1) if quick else (300, 3)
    make = lambda: mlp.make_job(width=WIDTH, steps=steps, name="tp")  # noqa: E731
    _plain_loop(make(), 5)
    plain, runtime = [], []
    with xshare.Runtime(memory="1GiB", policy="fifo") as rt:
        rt.submit(mlp.make_job(width=WIDTH, steps=5, name="warm")).result()  # compile outside the clock
        for r in range(rounds):
            t0 = time.perf_counter()
            _plain_loop(make(), steps)
            plain.append(steps / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            rt.submit(mlp.make_job(width=WIDTH, steps=steps, name=f"tp{r}")).result()
            runtime.append(steps / (time.perf_counter() - t0))
    p, x = statistics.median(plain), statistics.median(runtime)
    return Result("throughput", INFO, f"mlp w64, {steps} steps x {rounds}: runtime {x:.0f} steps/s, "
                  f"plain jit loop {p:.0f} steps/s ({x / p:.2f}x; medians, not a benchmark)",
                  figures={"runtime_steps_per_s": round(x, 1), "plain_steps_per_s": round(p, 1),
                           "ratio": round(x / p, 3), "steps": steps, "rounds": rounds})


# check_memory first: peak_bytes_in_use only rises, so its peaks are measured before any
# runtime has set a higher one.
CHECKS: list[Callable[[bool], Result]] = [check_memory, check_fences, check_arena, check_equivalence,
                                          check_fused, check_serving, check_throughput]


def run_selftest(quick: bool = False) -> dict:
    import jax

    start = time.perf_counter()
    load = os.getloadavg()[0]  # on a shared machine the figures are noisier: say so in the report
    results = []
    for fn in CHECKS:
        t0 = time.perf_counter()
        try:
            r = fn(quick)
        except Exception as e:  # noqa: BLE001 - one failing path must not hide the others
            r = Result(fn.__name__.removeprefix("check_"), FAIL, f"raised {type(e).__name__}: {e}",
                       "report it with the --report file")
        r.figures["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(r)
    d = jax.devices()[0]
    return {"quick": quick, "device": f"{d.platform}:{d.id} {d.device_kind}",
            "seconds": round(time.perf_counter() - start, 1), "ok": not any(r.status == FAIL for r in results),
            "checks": [asdict(r) for r in results], "cpu_count": os.cpu_count(),
            "load_avg_1m": round(load, 2)}


def to_markdown(report: dict) -> str:
    """The report as markdown, fit for RESULTS.md or an issue."""
    st = report.get("selftest") or {}
    pk = report.get("packages", {})
    lines = [f"# xshare doctor --selftest{' --quick' if st.get('quick') else ''}", "",
             f"- device: {st.get('device')} ({st.get('cpu_count')} CPU cores); backend "
             f"{report.get('devices', {}).get('default_backend')}",
             f"- load: 1-min load average {st.get('load_avg_1m')} at the start on {st.get('cpu_count')} cores"
             + (" (a shared, busy machine: timings are noisy)"
                if (st.get("load_avg_1m") or 0) > (st.get("cpu_count") or 1) else ""),
             f"- versions: xshare {pk.get('xshare')}, jax {pk.get('jax')}, jaxlib {pk.get('jaxlib')}, "
             f"flax {pk.get('flax')}, optax {pk.get('optax')}, Python {report.get('python', {}).get('version')}",
             f"- NVML driver: {report.get('nvml', {}).get('driver') or 'N/A'}; fences: "
             f"{', '.join(report.get('ffi', {}).get('platforms') or []) or 'none'}",
             f"- verdict: {'all checks passed' if report.get('ok') else 'FAILED'}; self-test {st.get('seconds')} s",
             "", "## Self-test", "", "| check | status | found | s |", "|---|---|---|---|"]
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    for c in st.get("checks", []):
        found = c["summary"] + (f" (fix: {c['fix']})" if c.get("fix") else "")
        lines.append(f"| {c['name']} | {c['status']} | {esc(found)} | {c['figures'].get('seconds')} |")
    models = next((c["figures"].get("models") for c in st.get("checks", []) if c["figures"].get("models")), None)
    if models:
        lines += ["", "## memory_analysis() against measured peaks", "",
                  "| model | P | E (predicted) | temp | measured above baseline | note |", "|---|---|---|---|---|---|"]
        for m in models:
            meas = format_bytes(m["measured_bytes"]) if m["measured_bytes"] is not None else "N/A"
            lines.append(f"| {m['model']} | {format_bytes(m['persistent_bytes'])} | {format_bytes(m['ephemeral_bytes'])} "
                         f"| {format_bytes(m['temp_bytes'])} | {meas} | {esc(m['note'] or '')} |")
    lines += ["", "## Environment checks", "", "| check | status | found |", "|---|---|---|"]
    for c in report.get("checks", []):
        lines.append(f"| {c['name']} | {c['status']} | {esc(c['summary'])} |")
    return "\n".join(lines) + "\n"
