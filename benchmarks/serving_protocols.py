"""gRPC against HTTP on one `xshare serve`, side by side in one run, with a plain single-model
server as the low-load reference (``python -m benchmarks.serving --protocols``).

One `xshare serve --grpc-port 0` serves one model (``xshare.models.inference:make_model``,
max_batch 16, the default batcher: no delay). Closed-loop clients (unmodified
``tritonclient.grpc`` / ``tritonclient.http``, one row per request, each client its own
connection) keep ``concurrency`` requests in flight for ``duration`` seconds after a short
unmeasured burn-in; per configuration: p50, p99 (from each request's send to its answer) and
requests/s. ``plain`` is benchmarks.serving's plain JAX server (one model, one process,
``jax.jit(predict)`` per request, the same Starlette + uvicorn stack, no batching) spoken to
over HTTP. HTTP requests are JSON (the plain server takes only JSON) sent with http.client,
gRPC raw bytes (what tritonclient.grpc always sends).

Found with it: every kept-alive HTTP request to either server took 40-48 ms (a response's head
and body, two writes, met the client's delayed ACK under Nagle's algorithm: asyncio sets
TCP_NODELAY only on sockets created with ``IPPROTO_TCP``); the runtime's server now creates its
socket so (xshare/runtime/web/server.py), as does the plain server here. Configurations alternate within each round, and each is
measured in ``rounds`` rounds, so drift on a shared machine falls on all alike.

    python -m benchmarks.serving --protocols [--duration 3] [--rounds 2] [--smoke] [--out DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

CONCURRENCY = (1, 4, 16)
WARMUP_S = 0.5


class GrpcService:
    """`xshare serve` with model ``m0`` on HTTP and gRPC (the default batcher)."""

    def __init__(self, tmp: Path):
        from benchmarks.serving import MODEL, _announced, _env

        run_dir = tmp / f"proto-{time.monotonic_ns()}"
        self.log = tmp / "proto-serve.log"
        args = [sys.executable, "-m", "xshare", "serve", "--memory", "1GiB", "--run-dir", str(run_dir),
                "--checkpoint-every", "0", "--grpc-port", "0",
                "--model", MODEL, "--set", "name=m0", "--set", "seed=0", "--set", "max_batch=16"]
        with open(self.log, "wb") as err:  # a file, not an unread pipe (benchmarks.serving.Service)
            self.proc = subprocess.Popen(args, env=dict(_env(), XSHARE_RUNTIME_DIR=str(tmp / "discovery")), cwd=tmp,
                                         stdout=subprocess.DEVNULL, stderr=err)
        rec = _announced(run_dir / "service.json", self.proc, self.log, self.stop)
        self.http, self.grpc, self.pid = rec["address"], rec["grpc_address"], self.proc.pid

    def stop(self) -> None:
        from benchmarks.serving import _stop

        _stop(self.proc)


def _client(kind: str, address: str) -> Any:
    if kind == "grpc":
        import tritonclient.grpc as grpcclient

        c = grpcclient.InferenceServerClient(address)

        def send(x: np.ndarray) -> np.ndarray:
            i = grpcclient.InferInput("x", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            return c.infer("m0", [i]).as_numpy("probs")
    else:
        # http.client with a JSON body, as benchmarks.serving's load sends (the plain server
        # reads only JSON); one kept-alive connection per client.
        import http.client

        host, port = address.rsplit(":", 1)
        c = http.client.HTTPConnection(host, int(port), timeout=60)

        def send(x: np.ndarray) -> np.ndarray:
            body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                           "data": x.ravel().tolist()}]}).encode()
            c.request("POST", "/v2/models/m0/infer", body, {"Content-Type": "application/json"})
            resp = c.getresponse()
            doc = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {doc[:200]!r}")
            return np.asarray(json.loads(doc)["outputs"][0]["data"], np.float32)
    return c, send


def closed_loop(kind: str, address: str, concurrency: int, duration: float) -> dict[str, Any]:
    """``concurrency`` clients sending one-row requests back to back; latencies after burn-in."""
    clients = [_client(kind, address) for _ in range(concurrency)]
    x = np.random.default_rng(0).normal(size=(1, 32)).astype(np.float32)
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    t_measure = time.perf_counter() + WARMUP_S
    t_end = t_measure + duration

    def worker(send: Any) -> None:
        mine: list[float] = []
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                break
            try:
                send(x)
            except Exception:  # noqa: BLE001 - counted, reported
                with lock:
                    errors[0] += 1
                continue
            if t0 >= t_measure:
                mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(send,)) for _, send in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c, _ in clients:
        c.close()
    lat.sort()
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: None)
    return {"protocol": kind, "concurrency": concurrency, "requests": len(lat), "errors": errors[0],
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "req_per_s": len(lat) / duration}


def run(args: Any) -> int:
    import tempfile

    from benchmarks.serving import PlainServers

    duration, rounds = (0.3, 1) if args.smoke else (args.duration, args.rounds)
    levels = (1, 4) if args.smoke else CONCURRENCY
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xshare-proto-") as tmp:
        svc = GrpcService(Path(tmp))
        plain = None
        try:
            plain = PlainServers(Path(tmp), 1)
            targets = {"grpc": svc.grpc, "http": svc.http, "plain": plain.targets[0][0]}
            rows: list[dict[str, Any]] = []
            for c in levels:
                for r in range(rounds):
                    order = ["grpc", "http", "plain"] if r % 2 == 0 else ["plain", "http", "grpc"]
                    for kind in order:
                        proto = "grpc" if kind == "grpc" else "http"
                        row = closed_loop(proto, targets[kind], c, duration)
                        row.update(server=kind, round=r)
                        rows.append(row)
                        print(f"  c={c:<3} {kind:<6} p50 {_fmt(row['p50_ms'])} ms  p99 {_fmt(row['p99_ms'])} ms  "
                              f"{row['req_per_s']:.0f} req/s  errors {row['errors']}", flush=True)
        finally:
            svc.stop()
            if plain is not None:
                plain.stop()
    summary = summarize(rows)
    doc = {"benchmark": "serving_protocols", "duration_s": duration, "rounds": rounds, "warmup_s": WARMUP_S,
           "machine": "shared (other work ran beside it)" if not args.smoke else "smoke", "runs": rows,
           "summary": summary}
    (out / "serving_protocols.json").write_text(json.dumps(doc, indent=2) + "\n")
    print("\nconcurrency  server  p50 ms  p99 ms  req/s   (medians over rounds)")
    for s in summary:
        print(f"{s['concurrency']:>11}  {s['server']:<6}  {_fmt(s['p50_ms']):>6}  {_fmt(s['p99_ms']):>6}  "
              f"{s['req_per_s']:>6.0f}")
    return 0 if all(r["errors"] == 0 and r["requests"] > 0 for r in rows) else 1


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (concurrency, server)."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        for kind in ("grpc", "http", "plain"):
            mine = [r for r in rows if r["concurrency"] == c and r["server"] == kind and r["p50_ms"] is not None]
            if mine:
                out.append({"concurrency": c, "server": kind,
                            **{k: float(np.median([r[k] for r in mine])) for k in ("p50_ms", "p99_ms", "req_per_s")}})
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
