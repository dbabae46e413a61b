"""The fence canary: the fences run first in a child process, where a crash hurts no job.

Before a runtime first compiles the XLA FFI fences into its jobs, ``gate(device)`` makes sure
they have passed on this machine: ``python -m xshare.ffi.canary --platform P`` runs a few
fenced steps of a small program on the device and checks what the fences recorded (one begin
and one end per step, timestamps monotone, each inside its step's wall time, results equal to
the unfenced step's). The verdict is cached per machine key (the check's version, the fences' source hash, jaxlib,
platform, device kind, driver) in ``$XDG_CACHE_HOME/xshare/canary/`` (``~/.cache``), so the
cost (one Python start, one jax start, one small compile: a few seconds) is paid once per
machine and per upgrade, not per runtime.

If the child crashes (a signal, a non-zero exit, no answer within the timeout) or a check
fails, the runtime runs without fences and says so once per process, naming ``xshare doctor``.

Environment:

* ``XSHARE_CANARY``: unset or ``auto`` (check once, cached); ``recheck`` (run the child again,
  once per process, and cache the new verdict); ``skip`` (trust the fences unchecked).
* ``XSHARE_CANARY_TIMEOUT_S``: how long the child may take (default 120 s: a cold jax start on
  a loaded machine takes tens of seconds).
* ``XSHARE_CANARY_FAULT``: for xshare's own tests only; the child fails on purpose (``abort``:
  SIGABRT after the fences are loaded; ``exit``: exit code 3; ``hang``: never answers;
  ``records``: one fence record is dropped before the check).

Importing this module imports no jax (``xshare doctor`` reads verdicts without starting it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from . import _build
from ._canary_check import FAULT_ENV, STEPS, CLOCK_SLACK_NS, check_records, run_canary  # noqa: F401

_log = logging.getLogger("xshare.ffi")

ENV = "XSHARE_CANARY"
TIMEOUT_ENV = "XSHARE_CANARY_TIMEOUT_S"
MODES = ("auto", "recheck", "skip")
FAULTS = ("abort", "exit", "hang", "records")
DEFAULT_TIMEOUT_S = 120.0
SCHEMA = "xshare.canary/v1"
CHECK_VERSION = 1  # bump when what the child checks changes: cached verdicts then lapse


@dataclass(frozen=True)
class Verdict:
    """What the canary found for one machine key."""

    ok: bool
    reason: str                 # "passed: ..." or why it failed (the child's own words)
    key: dict = field(default_factory=dict)
    seconds: float | None = None  # the child's wall time, start to answer
    checked_at: str | None = None  # UTC, ISO 8601
    cached: bool = False        # read from the cache file rather than run now
    path: str | None = None     # the cache file

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}


def mode() -> str:
    """``XSHARE_CANARY`` (default ``auto``); ValueError naming the valid values otherwise."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r} is not one of {', '.join(MODES)} "
                         f"(unset it for the default, auto)")
    return value


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a number of seconds > 0")
    return value


def driver_version(platform: str) -> str:
    """The GPU driver's version from NVML; "N/A" off NVIDIA GPUs or without NVML."""
    if platform not in ("gpu", "cuda"):
        return "N/A"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - no NVML: the key still separates by device kind
        return "N/A"


def machine_key(platform: str, device_kind: str, driver: str | None = None) -> dict:
    """What a verdict holds for: new fence sources, a new jaxlib, another device or driver
    each need a new check."""
    return {"check": CHECK_VERSION, "fences": _build.source_hash(), "jaxlib": _build.jaxlib_version(),
            "platform": platform, "device_kind": device_kind,
            "driver": driver_version(platform) if driver is None else driver}


_keys: dict[tuple[str, str], dict] = {}


def key_of(device: Any) -> dict:
    """``machine_key`` of a jax device, computed once per process and device kind (hashing
    the sources and asking NVML for the driver are not free, and every Runtime asks)."""
    kind = (device.platform, str(getattr(device, "device_kind", device.platform)))
    if kind not in _keys:
        _keys[kind] = machine_key(*kind)
    return dict(_keys[kind])


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xshare" / "canary"


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{key['platform']}-{digest}.json"


def read_cached(key: dict) -> Verdict | None:
    """The cached verdict for ``key``; None if there is none (or it is unreadable)."""
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or data.get("key") != key:
            return None
        return Verdict(ok=bool(data["ok"]), reason=str(data["reason"]), key=key,
                       seconds=data.get("seconds"), checked_at=data.get("checked_at"),
                       cached=True, path=str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cached(verdict: Verdict) -> Verdict:
    path = cache_path(verdict.key)
    out = Verdict(**{**asdict(verdict), "cached": False, "path": str(path)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out.to_json(), indent=1) + "\n")
        os.replace(tmp, path)  # atomic: two runtimes starting at once both read a whole file
    except OSError as e:  # a read-only home: the verdict still holds for this process
        _log.info("xshare.ffi: could not cache the canary verdict in %s: %s", path, e)
        out = Verdict(**{**asdict(out), "path": None})
    return out


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def run_child(platform: str, key: dict, *, timeout: float | None = None) -> Verdict:
    """Run the canary in a child process now and return its verdict (not cached)."""
    timeout = timeout_s() if timeout is None else timeout
    env = dict(os.environ)
    # The parent may hold most of the GPU already (preallocation): the child allocates what
    # it uses, a few KiB, instead of asking for its own 90%.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # The same xshare as this process, even where it is not installed (a checkout on sys.path).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "xshare.ffi.canary", "--platform", platform, "--steps", str(STEPS)]
    start = time.perf_counter()

    def verdict(ok: bool, reason: str) -> Verdict:
        return Verdict(ok=ok, reason=reason, key=key, seconds=round(time.perf_counter() - start, 3),
                       checked_at=_utc_now())

    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return verdict(False, f"the canary child did not answer within {timeout:g} s "
                              f"(raise {TIMEOUT_ENV} on a very slow machine)")
    except OSError as e:
        return verdict(False, f"could not start the canary child ({' '.join(cmd)}): {e}")
    answer = _last_json(proc.stdout)
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return verdict(False, f"the canary child was killed by {name}{_tail(proc.stderr)}")
    if answer is None:
        return verdict(False, f"the canary child exited with code {proc.returncode} "
                              f"without a verdict{_tail(proc.stderr)}")
    return verdict(bool(answer.get("ok")) and proc.returncode == 0, str(answer.get("reason")))


def _last_json(text: str) -> dict | None:
    for line in reversed((text or "").strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "ok" in data:
            return data
    return None


def _tail(stderr: str, lines: int = 3) -> str:
    kept = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()][-lines:]
    return (": " + " | ".join(kept))[:600] if kept else ""


_memo: dict[str, Verdict] = {}   # this process's verdicts, by cache file name
_warned: set[str] = set()
_lock = threading.Lock()


def check(device: Any, *, force: bool = False) -> Verdict:
    """The verdict for ``device``'s machine key: this process's, else the cache's, else the
    child's (run now and cached). ``force`` (or ``XSHARE_CANARY=recheck``, once per process)
    runs the child again."""
    key = key_of(device)
    name = cache_path(key).name
    recheck = force or mode() == "recheck"
    with _lock:
        hit = _memo.get(name)
        if hit is not None and not force:
            return hit
        found = None if recheck else read_cached(key)
        if found is None:
            with _machine_lock(cache_path(key)):
                # Another process (a Ray actor per GPU, starting at once) may have checked
                # while this one waited for the lock: one child per machine, not per process.
                found = None if recheck else read_cached(key)
                if found is None:
                    found = write_cached(run_child(device.platform, key))
        _memo[name] = found
        return found


@contextlib.contextmanager
def _machine_lock(path: Path):
    """An exclusive lock beside the cache file (flock: released if the holder dies); without
    a writable cache directory, no lock (each process then checks for itself)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def gate(device: Any) -> tuple[bool, Verdict | None]:
    """Whether a runtime on ``device`` may run the fences: (True, None) under
    ``XSHARE_CANARY=skip``, else the verdict's ``ok`` and the verdict. A failed verdict is
    logged once per process (per machine key), naming ``xshare doctor``."""
    if mode() == "skip":
        return True, None
    v = check(device)
    if not v.ok:
        with _lock:
            first = (v.path or v.reason) not in _warned
            _warned.add(v.path or v.reason)
        if first:
            _log.warning(
                "xshare.ffi: the fence canary failed on this machine (%s), so this runtime runs "
                "without XLA FFI fences (steps are timed on the host). Run `xshare doctor` for "
                "details; %s=recheck checks again%s.", v.reason, ENV,
                f" (verdict cached in {v.path})" if v.path else "")
    return v.ok, v


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m xshare.ffi.canary",
                                     description="Run the XLA FFI fences once and check them "
                                                 "(xshare runs this in a child process).")
    parser.add_argument("--platform", default=None, help="jax platform (default: the default backend)")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    if args.platform is None:
        import jax

        args.platform = jax.default_backend()
    try:
        ok, reason = run_canary(args.platform, args.steps)
    except Exception as e:  # noqa: BLE001 - reported as the verdict, never a traceback only
        ok, reason = False, f"{type(e).__name__}: {e}"
    print(json.dumps({"ok": ok, "reason": reason}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
