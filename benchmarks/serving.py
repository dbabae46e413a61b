"""Serving next to training, measured from the outside: an open-loop Poisson load generator in
its own process sends real HTTP requests (Open Inference Protocol JSON, one row each) and
measures per-model latency (from each request's *scheduled* arrival, so a server that falls
behind pays for its queue) and throughput; the servers' RSS is read with psutil.

Each measurement follows 2 s of the same load, unmeasured (burn-in). Cases (each a fresh set of
server processes):
  a  one model alone in its own `xshare serve`
  b  N models in one `xshare serve`
  c  the N models plus 2 training jobs (`xshare submit`) in that one service
  t  the 2 training jobs alone (the baseline for c's training throughput)
  d  the N models as N separate processes, each a plain JAX server on the same HTTP stack
     (Starlette + uvicorn, the same OIP parsing; `jax.jit(predict)` per request, no batching)

    python -m benchmarks.serving [--models 8] [--rate 20] [--duration 10] [--smoke] [--out DIR]

``--protocols`` runs gRPC against HTTP instead (benchmarks/serving_protocols.py).
``--capacity`` first finds one model's capacity and runs the cases at half of it. ``--count``
runs no load: it measures memory against the number of models served, k models deployed one by
one into one service vs m plain server processes (d's), and how many fit in this machine's RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = "xshare.models.inference:make_model"
WARMUP_S = 2.0  # seconds of unmeasured load before each measurement
TRAIN = ["xshare.models.mlp:make_job", "--set", "steps=10000000", "--set", "width=64"]
# The models' batcher delay (--max-delay-ms); None: the library's default, 0 (Triton's: no delay).
# Results before that default changed were measured with 2.
MAX_DELAY_MS: float | None = None


# ------------------------------------------------------------------------------ servers

def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


class Service:
    """`xshare serve` with ``n`` models (m0..m{n-1}) and, optionally, training jobs."""

    def __init__(self, tmp: Path, n: int, train: int = 0, memory: str = "1GiB"):
        self.run_dir = tmp / f"svc-{n}-{train}-{time.monotonic_ns()}"
        args = [sys.executable, "-m", "xshare", "serve", "--memory", memory, "--run-dir", str(self.run_dir),
                "--checkpoint-every", "0"]
        for i in range(n):
            args += ["--model", MODEL, "--set", f"name=m{i}", "--set", f"seed={i}", "--set", "max_batch=16"]
            if MAX_DELAY_MS is not None:
                args += ["--set", f"max_delay_ms={MAX_DELAY_MS:g}"]
        env = dict(_env(), XSHARE_RUNTIME_DIR=str(tmp / "discovery"))
        # stderr to a file, never an unread pipe: the service logs a line per deploy, and a full
        # pipe (64 KiB, a few hundred deploys) blocks it mid-write.
        self.log = tmp / f"svc-{n}-{train}-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(args, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=err)
        rec = _announced(self.run_dir / "service.json", self.proc, self.log, self.stop)
        self.address, self.token, self.pids = rec["address"], rec["token"], [self.proc.pid]
        self.targets = [(self.address, f"m{i}") for i in range(n)]
        if train:
            seeds = ",".join(str(s) for s in range(train)) if train > 1 else "0"
            done = subprocess.run([sys.executable, "-m", "xshare", "submit", *TRAIN, "--set", f"seed={seeds}",
                                   "--address", self.address, "--token", rec["token"]],
                                  env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                self.stop()
                raise RuntimeError(f"xshare submit failed: {done.stderr}")
            time.sleep(1.0)  # past the jobs' first steps (their compile is behind the submit's answer)

    def steps(self) -> int:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.address}/status", timeout=30) as resp:
            return sum(j["steps_done"] for j in json.loads(resp.read())["jobs"])

    def stop(self) -> None:
        _stop(self.proc)


class PlainServers:
    """``n`` processes, each one model behind a plain JAX server (``--plain-server``)."""

    def __init__(self, tmp: Path, n: int):
        self.tmp, self.procs, self.targets, self.pids = tmp, [], [], []
        for _ in range(n):
            self.add()

    def add(self) -> tuple[str, str]:
        """Start one more (model ``m{i}``, seed ``i``) and wait until it listens; its target."""
        i = len(self.procs)
        port_file = self.tmp / f"plain-{i}-{time.monotonic_ns()}.port"
        log = port_file.with_suffix(".log")
        with open(log, "wb") as err:  # a file, not an unread pipe (see Service)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.serving", "--plain-server", str(i), "--port-file", str(port_file)],
                env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=err))
        self.pids.append(self.procs[-1].pid)
        deadline = time.monotonic() + 300
        while not port_file.exists() or not port_file.read_text().strip():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"plain server {i} did not start: {_tail(log)}")
            time.sleep(0.1)
        self.targets.append((f"127.0.0.1:{port_file.read_text().strip()}", f"m{i}"))
        return self.targets[-1]

    def stop(self) -> None:
        for p in self.procs:
            _stop(p)


def _announced(announce: Path, proc: Any, log: Path, stop: Any) -> dict:
    """The record an ``xshare serve`` writes once it listens (``stop()`` and raise if it exits
    or takes over 300 s first)."""
    deadline = time.monotonic() + 300
    while not announce.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"xshare serve did not start: {_tail(log)}")
        time.sleep(0.1)
    return json.loads(announce.read_text())


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plain_server(index: int, port_file: Path) -> None:
    """One model, one process: ``jax.jit(predict)`` per request behind Starlette + uvicorn."""
    import asyncio
    import socket

    import jax
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from xshare.models import inference
    from xshare.runtime.web.http_app import Reply
    from xshare.serving.oip import parse_infer, render_infer

    spec = inference.make_model(name=f"m{index}", seed=index, max_batch=16)
    params = jax.device_put(spec.params)
    predict = jax.jit(spec.predict)
    meta = {"name": spec.name, "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}],
            "outputs": [{"name": "label", "datatype": "INT32", "shape": [-1]},
                        {"name": "probs", "datatype": "FP32", "shape": [-1, 10]}]}
    predict(params, {"x": jax.numpy.zeros((1, 32), "float32")})  # compile before announcing

    def run(body: bytes) -> bytes:
        inputs, wanted, binary, rid = parse_infer(body, None, meta)
        out = {k: jax.device_get(v) for k, v in predict(params, inputs).items()}
        return render_infer(spec.name, rid, out, wanted, binary)[0]

    async def infer(request: Request) -> Response:
        try:
            return Response(await run_in_threadpool(run, await request.body()), 200, media_type="application/json")
        except Reply as r:
            return JSONResponse({"error": r.message}, r.code)

    app = Starlette(routes=[Route(f"/v2/models/{spec.name}/infer", infer, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY: see server.py
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, http="h11", lifespan="off", log_config=None, access_log=False))
    port_file.write_text(str(sock.getsockname()[1]))
    asyncio.run(server.serve(sockets=[sock]))


# ------------------------------------------------------------------------------ load

def load(targets: list[tuple[str, str]], rate: float, duration: float, seed: int = 0) -> dict[str, Any]:
    """Open loop: Poisson arrivals at ``rate``/s per target for ``duration`` s, each request sent
    at its arrival time by a pool of keep-alive clients; latency from the scheduled arrival."""
    import http.client

    import numpy as np

    rng = np.random.default_rng(seed)
    arrivals = []
    for k, _target in enumerate(targets):
        t = 0.0
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= duration:
                break
            arrivals.append((t, k))
    arrivals.sort()
    x = rng.normal(size=(1, 32)).astype("float32").ravel().tolist()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": x}]}).encode()
    local = threading.local()
    lat: list[list[float]] = [[] for _ in targets]
    errors = [0] * len(targets)
    failures: list[str] = []

    def send(t_sched: float, k: int) -> None:
        address, name = targets[k]
        conns = local.__dict__.setdefault("conns", {})
        status: Any = None
        for _attempt in range(2):  # a kept-alive connection the server closed meanwhile: once more, fresh
            reused = address in conns
            try:
                conn = conns.get(address)
                if conn is None:
                    host, port = address.rsplit(":", 1)
                    conn = conns[address] = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request("POST", f"/v2/models/{name}/infer", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                status = resp.status
                break
            except (OSError, http.client.HTTPException) as err:
                conns.pop(address, None)
                status = type(err).__name__
                if not reused:
                    break
        if status == 200:
            lat[k].append(time.perf_counter() - t0 - t_sched)
        else:
            errors[k] += 1
            failures.append(str(status))

    pool = ThreadPoolExecutor(max_workers=32)
    t0 = time.perf_counter()
    for t_sched, k in arrivals:
        delay = t0 + t_sched - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pool.submit(send, t_sched, k)
    pool.shutdown(wait=True)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "sent": len(arrivals), "latencies_s": lat, "errors": errors,
            "failures": sorted(set(failures))}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_load_in_child(targets: list[tuple[str, str]], rate: float, duration: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--load", json.dumps(targets),
                           "--rate", str(rate), "--duration", str(duration)],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=int(duration * 5 + 300))
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rss_bytes(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            total += p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return total


# ------------------------------------------------------------------------------ cases

def measure(case: str, servers: Any, rate: float, duration: float, train: bool = False) -> dict[str, Any]:
    try:
        if servers.targets:  # burn-in, not measured: first connections, first calls, allocator
            run_load_in_child(servers.targets, rate, WARMUP_S)
        steps0, t0 = (servers.steps(), time.perf_counter()) if train else (None, None)
        result = (run_load_in_child(servers.targets, rate, duration) if servers.targets
                  else (time.sleep(duration) or {"wall_s": duration, "sent": 0, "latencies_s": [], "errors": []}))
        train_sps = (servers.steps() - steps0) / (time.perf_counter() - t0) if train else None
        rss = rss_bytes(servers.pids)
    finally:
        servers.stop()
    lat = result["latencies_s"]
    every = [x for per in lat for x in per]
    per_model_p99 = [_pct(v, 0.99) for v in lat if v]
    return {"case": case, "models": len(servers.targets), "rate_per_model": rate, "sent": result["sent"],
            "answered": len(every), "errors": sum(result["errors"]), "failures": result.get("failures", []),
            "throughput_rps": len(every) / result["wall_s"] if result["wall_s"] else 0.0,
            "p50_ms": None if not every else 1e3 * _pct(every, 0.5),
            "p99_ms": None if not every else 1e3 * _pct(every, 0.99),
            "worst_model_p99_ms": None if not per_model_p99 else 1e3 * max(per_model_p99),
            "train_steps_per_s": train_sps, "rss_mib": rss / 2**20,
            "quantiles_ms": {str(q): (None if not every else 1e3 * _pct(every, q)) for q in _QUANTILES}}


_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def plot(cases: list[dict[str, Any]], path: Path) -> None:
    """Latency quantiles per case (log scale): the figure RESULTS.md shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cases:
        qs = [(float(q), v) for q, v in c["quantiles_ms"].items() if v is not None]
        if qs:
            ax.plot([100 * q for q, _ in qs], [v for _, v in qs], marker="o", label=c["case"])
    ax.set_yscale("log")
    ax.set_xlabel("percentile of requests")
    ax.set_ylabel("latency, ms (from scheduled arrival)")
    _save(fig, ax, "Request latency per case (open-loop Poisson load)", path)


def _save(fig: Any, ax: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capacity(tmp: Path, rates: list[float], duration: float) -> tuple[float | None, list[dict[str, Any]]]:
    """One model alone in its own service under rising open-loop rates: its capacity is the
    highest rate whose requests were all answered with p99 under 250 ms (past it the queue, and
    so the tail, grows for as long as the load lasts)."""
    best, steps = None, []
    svc = Service(tmp, 1)
    try:
        run_load_in_child(svc.targets, rates[0], WARMUP_S)  # burn-in, not measured
        for rate in rates:
            r = run_load_in_child(svc.targets, rate, duration)
            every = r["latencies_s"][0]
            p99 = _pct(every, 0.99)
            ok = not sum(r["errors"]) and len(every) == r["sent"] and p99 is not None and p99 < 0.25
            steps.append({"rate": rate, "answered_rps": len(every) / r["wall_s"], "p99_ms": None if p99 is None
                          else 1e3 * p99, "errors": sum(r["errors"]), "ok": ok})
            print(f"capacity: {rate:g}/s -> {steps[-1]}", file=sys.stderr, flush=True)
            if not ok:
                break
            best = rate
    finally:
        svc.stop()
    return best, steps


# ------------------------------------------------------------------------------ count

COUNT_KS = (1, 8, 32, 128, 512, 1024)  # models deployed into one service, cumulatively (1024: ~0.5 GiB RSS)
COUNT_MS = (1, 2, 4, 8)         # plain single-model server processes, cumulatively (8: ~2.4 GiB RSS)
COUNT_BOUND = 3 * 2**30         # stop growing either way past this RSS: never fill a shared machine
COUNT_RESERVE = 4 * 2**30       # of the machine's RAM, kept out of the budget (OS, page cache, others)
COUNT_SETTLE_S = 0.5            # after the last request, before memory is read (the completion thread frees)


def memory_of(pids: list[int]) -> dict[str, int]:
    """RSS, PSS and USS summed over ``pids`` and their children. Summed RSS counts the shared
    pages (libjax, libpython, numpy's .so) once per process; PSS splits each shared page among
    the processes that map it, so summed PSS is what they cost the machine together."""
    import psutil

    total = {"rss": 0, "pss": 0, "uss": 0}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p, *p.children(recursive=True)]:
                m = q.memory_full_info()  # reads /proc/PID/smaps: our own processes only
                total["rss"] += m.rss
                total["pss"] += m.pss
                total["uss"] += m.uss
        except psutil.NoSuchProcess:
            pass
    return total


def infer_once(address: str, name: str, seed: int) -> bool:
    """One real request (one row, JSON) to model ``name``: True if it answered 200 with one label
    and one row of 10 probabilities, so the model is compiled, resident and served."""
    import http.client

    import numpy as np

    x = np.random.default_rng(seed).normal(size=32).astype("float32").tolist()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": x}]})
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", f"/v2/models/{name}/infer", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    if resp.status != 200:
        return False
    outs = {o["name"]: o for o in json.loads(raw).get("outputs", [])}
    return (outs.get("label", {}).get("shape") == [1] and outs.get("probs", {}).get("shape") == [1, 10]
            and len(outs["probs"].get("data", [])) == 10)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``y = base + slope * n`` over the measured points; (slope, base)."""
    import numpy as np

    n, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(set(n)) < 2:
        raise SystemExit(f"count: a line needs two distinct counts; measured {sorted(set(n))}")
    slope, base = np.polyfit(n, y, 1)
    return float(slope), float(base)


def count(tmp: Path, ks: tuple[int, ...], ms: tuple[int, ...], bound: int) -> dict[str, Any]:
    """Memory per model both ways, measured on live servers: k models deployed one by one into
    one ``xshare serve`` (``POST /models``, as ``xshare deploy`` does), and m plain single-model
    server processes started one by one. At each measured k (or m) every model not yet asked
    answers one real request first, then memory is read. Stops growing a side past ``bound``."""
    from xshare.service import client

    service: list[dict[str, Any]] = []
    # An 8 GiB arena: a bookkeeping budget on CPU (nothing is preallocated), so admission never
    # stops the count before RSS does; each model reserves well under a MiB of it.
    svc = Service(tmp, 0, memory="8GiB")
    try:
        time.sleep(COUNT_SETTLE_S)
        service.append({"n": 0, **memory_of(svc.pids), "answered": 0, "grow_s": 0.0})
        print(f"count: service with 0 models -> {service[-1]}", file=sys.stderr, flush=True)
        target, deployed = client.Service(svc.address, svc.token), 0
        for k in ks:
            t = time.perf_counter()
            new = []
            while deployed < k:
                name = f"m{deployed}"
                client.call(target, "POST", "/models", {"entry": MODEL, "name": name, "params": {
                    "seed": deployed, "max_batch": 16,
                    **({"max_delay_ms": MAX_DELAY_MS} if MAX_DELAY_MS is not None else {})}}, timeout=300)
                new.append(name)
                deployed += 1
            grow_s = time.perf_counter() - t
            answered = sum(infer_once(svc.address, name, i) for i, name in enumerate(new))
            time.sleep(COUNT_SETTLE_S)
            service.append({"n": k, **memory_of(svc.pids), "answered": service[-1]["answered"] + answered,
                            "grow_s": grow_s})
            print(f"count: service with {k} models -> {service[-1]}", file=sys.stderr, flush=True)
            if service[-1]["rss"] > bound:
                break
    finally:
        svc.stop()

    procs: list[dict[str, Any]] = []
    plain = PlainServers(tmp, 0)
    try:
        answered = 0
        for m in ms:
            t = time.perf_counter()
            new = [plain.add() for _ in range(m - len(plain.procs))]
            grow_s = time.perf_counter() - t
            answered += sum(infer_once(address, name, i) for i, (address, name) in enumerate(new))
            time.sleep(COUNT_SETTLE_S)
            procs.append({"n": m, **memory_of(plain.pids), "answered": answered, "grow_s": grow_s})
            print(f"count: {m} plain servers -> {procs[-1]}", file=sys.stderr, flush=True)
            if procs[-1]["rss"] > bound:
                break
    finally:
        plain.stop()
    return {"service": service, "processes": procs}


def count_summary(points: dict[str, list[dict[str, Any]]], budget: int) -> dict[str, Any]:
    """Per side and per metric (RSS, PSS): the fitted marginal bytes per model and base, and how
    many models fit in ``budget`` bytes by that line (extrapolated past the largest measured count)."""
    out: dict[str, Any] = {"budget_bytes": budget}
    for side, rows in points.items():
        measured = [r for r in rows if r["n"] >= 1]  # the empty service is a reference, not a fit point
        for metric in ("rss", "pss"):
            slope, base = fit_line([(r["n"], r[metric]) for r in measured])
            fits = int((budget - base) // slope) if slope > 0 else None
            out[f"{side}_{metric}"] = {
                "marginal_bytes": slope, "base_bytes": base, "count": fits,
                "per_gib": 2**30 / slope if slope > 0 else None,
                "extrapolated": fits is not None and fits > max(r["n"] for r in measured)}
    for metric in ("rss", "pss"):
        a, b = out[f"service_{metric}"]["count"], out[f"processes_{metric}"]["count"]
        out[f"ratio_{metric}"] = a / b if a and b else None
    return out


def plot_count(points: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    """Memory against models, both ways, with the fitted lines (the figure RESULTS.md shows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side, label, colour in (("service", "one xshare serve, k models", "C0"),
                                ("processes", "k plain JAX server processes", "C3")):
        rows = points[side]
        for metric, style in (("rss", "o-"), ("pss", "s--")):
            ax.plot([r["n"] for r in rows], [r[metric] / 2**20 for r in rows], style, color=colour,
                    label=f"{label} ({metric.upper()})", alpha=1.0 if metric == "pss" else 0.5)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("models served")
    ax.set_ylabel("memory, MiB (summed over processes)")
    _save(fig, ax, "Memory per model: one service vs one process per model", path)


def run_count(args: argparse.Namespace) -> int:
    import psutil

    from xshare.bench import harness

    ks, ms = ((1, 2, 4), (1, 2)) if args.smoke else (COUNT_KS, COUNT_MS)
    machine = harness.machine()
    total = psutil.virtual_memory().total
    budget = total - COUNT_RESERVE
    with tempfile.TemporaryDirectory(prefix="xshare-serving-count-") as tmp_:
        points = count(Path(tmp_), ks, ms, COUNT_BOUND)
    summary = count_summary(points, budget)
    mib = 2**20
    rows = [[side, r["n"], f"{r['rss'] / mib:.0f}", f"{r['pss'] / mib:.0f}", f"{r['uss'] / mib:.0f}",
             f"{r['answered']}/{r['n']}", f"{r['grow_s']:.1f}"]
            for side, key in (("one service", "service"), ("plain processes", "processes")) for r in points[key]]
    fits = harness.markdown_table(
        ["way", "metric", "marginal MiB per model", "base MiB", "models per GiB", f"fit in {budget / 2**30:.1f} GiB"],
        [[side, metric.upper(), f"{s['marginal_bytes'] / mib:.2f}", f"{s['base_bytes'] / mib:.0f}",
          f"{s['per_gib']:.1f}", f"{s['count']}{' (extrapolated)' if s['extrapolated'] else ''}"]
         for side in ("service", "processes") for metric in ("rss", "pss") for s in [summary[f"{side}_{metric}"]]])
    def big(side: str) -> str:
        last = points[side][-1]
        return f"{last['n']} ({last['rss'] / 2**30:.2f} GiB RSS together)"

    ratio = " ".join(f"{m.upper()} {summary[f'ratio_{m}']:.1f}x;" for m in ("rss", "pss")
                     if summary[f"ratio_{m}"] is not None)
    harness.write_results(
        "serving_count", Path(args.out), title="Serving: how many small models fit, one service vs one process each",
        columns=["way", "models", "RSS MiB", "PSS MiB", "USS MiB", "answered", "grow s"], rows=rows,
        machine_info=machine, config={"ks": list(ks), "ms": list(ms), "bound_bytes": COUNT_BOUND,
                                      "total_ram_bytes": total, "reserve_bytes": COUNT_RESERVE,
                                      "budget_bytes": budget, "model": MODEL},
        data={"points": points, "summary": summary}, smoke=args.smoke,
        notes=(f"![memory per model](serving_count.png)\n\n{fits}\n\n"
               f"Models that fit, service over processes: {ratio}\n\n"
               f"Budget: this machine's RAM ({total / 2**30:.1f} GiB) less a {COUNT_RESERVE / 2**30:.0f} GiB reserve "
               f"= {budget / 2**30:.1f} GiB. Counts are extrapolated along the least-squares lines through the "
               f"measured points (models >= 1); the machine was never filled: a side stops growing at the first "
               f"measured count past {COUNT_BOUND / 2**30:.0f} GiB RSS (largest here: the service with "
               f"{big('service')} models, {big('processes')} processes). Model: `{MODEL}` (mlp, max_batch 16, buckets 1/4/16). "
               "One service: `xshare serve` with an empty start, then `POST /models` (what `xshare deploy` sends) "
               "one model at a time; processes: plain JAX servers (case d), started one at a time. At each "
               "measured count every model not yet asked answered one real infer request over HTTP before "
               f"memory was read ({COUNT_SETTLE_S:g} s later; 'answered' counts them). Memory is summed over the "
               "server processes and their children: summed RSS counts shared library pages once per process, "
               "PSS splits them among the processes mapping them (what they cost together); USS is each "
               "process's private memory. 'grow s': deploying (compiles included) or starting the step's new "
               "models."))
    plot_count(points, summary, Path(args.out) / "serving_count.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s per model (Poisson)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per case")
    parser.add_argument("--smoke", action="store_true", help="2 models, 1 s of load: checks the plumbing")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--capacity", action="store_true",
                        help="first find one model's capacity (rising rates), then run every case at half "
                             "of it per model (the issue's target: c's p99 <= 2x a's there)")
    parser.add_argument("--count", action="store_true",
                        help="instead of the cases: memory per model, k models deployed into one service vs m "
                             "plain single-model server processes, and how many fit in this machine's RAM "
                             "(serving_count.md)")
    parser.add_argument("--protocols", action="store_true",
                        help="instead of the cases: gRPC against HTTP on one xshare serve at concurrency 1, 4, 16 "
                             "(p50, p99, requests/s), beside a plain single-model server (benchmarks/serving_protocols.py)")
    parser.add_argument("--max-delay-ms", type=float,
                        help="the models' batcher delay (default: the library's, 0 = no delay, Triton's default)")
    parser.add_argument("--rounds", type=int, default=2, help="with --protocols: rounds, configurations alternating")
    parser.add_argument("--plain-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global MAX_DELAY_MS
    MAX_DELAY_MS = args.max_delay_ms
    if args.plain_server is not None:
        plain_server(args.plain_server, Path(args.port_file))
        return 0
    if args.load is not None:
        print(json.dumps(load([tuple(t) for t in json.loads(args.load)], args.rate, args.duration)))
        return 0
    if args.protocols:
        from benchmarks.serving_protocols import run as run_protocols

        return run_protocols(args)
    if args.count:
        return run_count(args)

    from xshare.bench import harness

    n, rate, duration = (2, 5.0, 1.0) if args.smoke else (args.models, args.rate, args.duration)
    machine = harness.machine()
    rows, data = [], []
    cap, cap_steps = None, []
    with tempfile.TemporaryDirectory(prefix="xshare-serving-") as tmp_:
        tmp = Path(tmp_)
        if args.capacity:
            cap, cap_steps = capacity(tmp, [25.0, 50.0, 100.0, 200.0, 400.0, 800.0][:2 if args.smoke else 6],
                                      min(duration, 5.0))
            if cap is None:
                raise SystemExit("capacity: not even the lowest rate was served within the bounds")
            rate = cap / 2
        cases = [("a: 1 model, own service", lambda: Service(tmp, 1), False),
                 (f"b: {n} models, one service", lambda: Service(tmp, n), False),
                 (f"c: {n} models + 2 training jobs", lambda: Service(tmp, n, train=2), True),
                 ("t: 2 training jobs alone", lambda: Service(tmp, 0, train=2), True),
                 (f"d: {n} plain JAX servers", lambda: PlainServers(tmp, n), False)]
        for name, start, train in cases:
            print(f"case {name} ...", file=sys.stderr, flush=True)
            r = measure(name, start(), rate, duration, train)
            data.append(r)
            rows.append([name, r["models"], f"{r['throughput_rps']:.1f}", _fmt(r["p50_ms"]), _fmt(r["p99_ms"]),
                         _fmt(r["worst_model_p99_ms"]), r["errors"], _fmt(r["train_steps_per_s"], 0),
                         f"{r['rss_mib']:.0f}"])
    result_name = "serving_capacity" if args.capacity else "serving"
    harness.write_results(
        result_name, Path(args.out), title="Serving: models next to training vs one process per model",
        columns=["case", "models", "answered/s", "p50 ms", "p99 ms", "worst model p99 ms", "errors",
                 "train steps/s", "RSS MiB"],
        rows=rows, machine_info=machine, config={"models": n, "rate_per_model": rate, "duration_s": duration,
                                                 "max_delay_ms": 0.0 if MAX_DELAY_MS is None else MAX_DELAY_MS},
        data={"cases": data, "capacity_rps": cap, "capacity_steps": cap_steps}, smoke=args.smoke,
        notes=(f"![latency per case]({result_name}.png)\n\n"
               + (f"One model's capacity alone: {cap:g} requests/s (steps: {cap_steps}); every case ran at "
                  f"half of it per model.\n\n" if cap else "")
               +
               f"Open-loop Poisson load, {rate:g} requests/s per model, one 32-float row per request (JSON), "
               f"{duration:g} s per case, from a separate process over loopback HTTP. Latency from each "
               "request's scheduled arrival. RSS: the server processes (and their children) at the end."))
    plot(data, Path(args.out) / f"{result_name}.png")
    return 0


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
