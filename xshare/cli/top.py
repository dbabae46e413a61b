"""``xshare top``: what the running runtimes are doing, from their ``/status`` endpoints.

It finds runtimes through their discovery files (or ``--address``), asks each for ``/status``
and draws: a header and device line per runtime, the arena as a bar split per job with its
free space, a lanes table and a jobs table. Live mode redraws every ``--interval`` seconds and
reads keys on a thread (cbreak mode): ``q`` quits, ``↑``/``↓`` select a job, ``p`` pauses or
resumes it (with the token from the runtime's discovery file or ``--token``), ``s`` cycles the
sort key. ``--once`` prints one rendering; ``--json`` prints the status itself (NDJSON, one
line per refresh, with ``--interval``). Off a terminal it behaves like ``--once``.

A client of the HTTP API only: it never imports jax's runtime side nor touches a device.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from xshare._units import format_bytes

EXIT_OK, EXIT_NONE = 0, 1
SORT_KEYS = ("id", "name", "status", "lane", "steps/s", "share")
_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
            "bright_green", "bright_yellow", "bright_blue", "bright_red")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", "-1", action="store_true",
                        help="print one rendering and exit (the default when stdout is not a terminal)")
    parser.add_argument("--json", action="store_true",
                        help="print /status as JSON: one object, or {\"runtimes\": [...]} for several; "
                             "with --interval, one line per refresh (NDJSON)")
    parser.add_argument("--interval", type=_positive_float, default=None, metavar="S",
                        help="seconds between refreshes (default 1)")
    parser.add_argument("--iterations", "-n", type=int, default=None, metavar="N",
                        help="stop after N refreshes (live and NDJSON modes)")
    parser.add_argument("--address", metavar="HOST:PORT",
                        help="a runtime's status address (default: every runtime found in the discovery directory)")
    parser.add_argument("--token", help="the runtime's control token (default: from its discovery file)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 seconds")
    return value


# ---------------------------------------------------------------------------------------- client

@dataclass
class Target:
    """A runtime to ask: its address and, when we have it, its control token."""

    address: str
    token: str | None = None
    pid: int | None = None


@dataclass
class View:
    """What one runtime said this refresh: its status, or why there is none."""

    target: Target
    status: dict[str, Any] | None = None
    error: str | None = None


def fetch_status(address: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/status", timeout=timeout) as resp:
        return json.loads(resp.read())


def control(target: Target, job: str, action: str, payload: Any = None, timeout: float = 5.0) -> dict[str, Any]:
    """POST a control action; returns the server's JSON. Raises RuntimeError with its error text."""
    from urllib.parse import quote

    body = json.dumps(payload).encode() if payload is not None else b""
    req = urllib.request.Request(f"http://{target.address}/jobs/{quote(job, safe='')}/{action}",
                                 data=body, method="POST",
                                 headers={"Authorization": f"Bearer {target.token or ''}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("error", "")
        except ValueError:
            message = ""
        raise RuntimeError(f"{err.code} {message}".strip()) from None
    except (OSError, ValueError) as err:
        raise RuntimeError(f"{target.address} unreachable: {err}") from None


def find_targets(args: argparse.Namespace) -> list[Target]:
    from xshare.runtime.server import discover

    found = discover()
    if args.address:
        token = args.token
        pid = None
        for rec in found:  # a discovery file for this address lends its token
            if rec["address"] == args.address:
                token = token or rec.get("token")
                pid = rec["pid"]
        return [Target(args.address, token, pid)]
    return [Target(rec["address"], args.token or rec.get("token"), rec["pid"]) for rec in found]


def fetch_all(targets: Iterable[Target]) -> list[View]:
    views = []
    for t in targets:
        try:
            views.append(View(t, status=fetch_status(t.address)))
        except (OSError, ValueError) as err:
            views.append(View(t, error=_why(err)))
    return views


def _why(err: BaseException) -> str:
    reason = getattr(err, "reason", None)
    return str(reason if reason is not None else err)


def _none_found(args: argparse.Namespace) -> int:
    from xshare.runtime.server import discovery_dir

    if args.address:
        print(f"xshare top: no xshare runtime answers at {args.address}", file=sys.stderr)
    else:
        print(f"xshare top: no running xshare runtime found in {discovery_dir()} "
              "(start one with status_port=0, e.g. Runtime(status_port=0), or pass --address HOST:PORT; "
              "XSHARE_RUNTIME_DIR overrides the directory)", file=sys.stderr)
    return EXIT_NONE


# ------------------------------------------------------------------------------------ entry point

def run(args: argparse.Namespace) -> int:
    targets = find_targets(args)
    if not targets:
        return _none_found(args)
    if args.json:
        return _json(args)
    if args.once or not sys.stdout.isatty():
        views = fetch_all(targets)
        if not any(v.status for v in views):
            for v in views:
                print(f"xshare top: {v.target.address}: {v.error}", file=sys.stderr)
            return _none_found(args)
        from xshare.cli.render import console

        con = console()
        con.print(render(views, UI(), con.width))
        return EXIT_OK
    return _live(args)


def _json(args: argparse.Namespace) -> int:
    """One JSON object (no --interval) or one NDJSON line per refresh, until Ctrl-C, the end
    of the pipe, ``--iterations``, or no runtime answering any more."""
    try:
        return _json_loop(args)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `xshare top --json --interval 1 | head -3`
        sys.stderr.close()  # nothing more can be said; keep Python quiet at exit
        return EXIT_OK


def _json_loop(args: argparse.Namespace) -> int:
    printed = 0
    while True:
        views = fetch_all(find_targets(args))
        for v in views:
            if v.error:
                print(f"xshare top: {v.target.address}: {v.error}", file=sys.stderr)
        ok = [v.status for v in views if v.status is not None]
        if not ok:
            return EXIT_OK if printed else _none_found(args)
        doc = ok[0] if len(ok) == 1 else {"runtimes": ok}
        if args.interval is None:
            print(json.dumps(doc, indent=2))
            return EXIT_OK
        print(json.dumps(doc), flush=True)
        printed += 1
        if args.iterations is not None and printed >= args.iterations:
            return EXIT_OK
        time.sleep(args.interval)


# ------------------------------------------------------------------------------------- rendering

@dataclass
class UI:
    """The live view's state: the selected job, the sort key, the last message."""

    selected: tuple[str, str] | None = None   # (runtime address, job name)
    sort: str = "id"
    message: str = ""
    live: bool = False


def ordered_jobs(status: dict[str, Any], sort: str) -> list[dict[str, Any]]:
    jobs = list(status.get("jobs", []))
    order = {"queued": 0, "running": 1, "paused": 2, "failed": 3, "cancelled": 4, "done": 5}
    keys: dict[str, Callable[[dict], Any]] = {
        "id": lambda j: j["id"],
        "name": lambda j: j["name"],
        "status": lambda j: (order.get(j["status"], 9), j["id"]),
        "lane": lambda j: (j["lane"] is None, j["lane"] or 0, j["id"]),
        "steps/s": lambda j: (-(j["steps_per_s"] or 0.0), j["id"]),
        "share": lambda j: (-(j["device_time_share"] or 0.0), j["id"]),
    }
    return sorted(jobs, key=keys.get(sort, keys["id"]))


def selectable(views: list[View], sort: str) -> list[tuple[str, str]]:
    return [(v.target.address, j["name"]) for v in views if v.status for j in ordered_jobs(v.status, sort)]


def render(views: list[View], ui: UI, width: int = 160) -> Any:
    """The whole screen; ``width`` (the console's) decides which columns the tables keep."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = []
    if not views:
        parts.append(Text("no running xshare runtime (waiting for one; q quits)", style="yellow"))
    colors: dict[str, str] = {}
    for v in views:
        if v.status is None:
            parts.append(Text(f"runtime at {v.target.address}: unreachable ({v.error})", style="red"))
            continue
        s = v.status
        for j in s["jobs"]:
            colors.setdefault(j["name"], _PALETTE[j["id"] % len(_PALETTE)])
        bar = _arena_bar(s, colors, max(min(width - 2, 100), 10))
        parts += [_header(v), _device_line(s), _arena_line(s), bar,
                  _lanes_table(s, width), _jobs_table(v, ui, colors, width)]
        parts.append(Text(""))
    if ui.live:
        keys = Text(f"q quit  ↑/↓ select  p pause/resume  s sort (by {ui.sort})", style="dim")
        if ui.message:
            keys.append("   ")
            keys.append(ui.message, style="bold")
        parts.append(keys)
    return Group(*parts)


def _header(v: View) -> Any:
    from rich.text import Text

    from xshare.cli.render import fmt_seconds

    rt = v.status["runtime"]
    t = Text()
    t.append("xshare ", style="bold")
    t.append(f"{rt['version']}  pid {rt['pid']}  at {v.target.address}  ")
    t.append(f"policy {rt['policy']}  quantum {rt['quantum']}  fences {'on' if rt['fences'] else 'off'}  "
             f"up {fmt_seconds(rt['uptime_s'])}")
    if rt.get("closed"):
        t.append("  (closing)", style="yellow")
    return t


def _na(x: Any, fmt: Callable[[Any], str]) -> str:
    return "N/A" if x is None else fmt(x)


def _device_line(s: dict[str, Any]) -> Any:
    from rich.text import Text

    d = s["device"]
    t = Text()
    t.append("Device ", style="bold")
    t.append(f"{d['platform']}:{d['id']} ({d['name'] or d['kind']})  ")
    t.append(f"util {_na(d['utilization_percent'], lambda u: f'{u:.0f}%')}  ")
    used, total = d["memory_used_bytes"], d["memory_total_bytes"]
    mem = "N/A" if used is None or total is None else f"{format_bytes(used)} / {format_bytes(total)}"
    t.append(f"mem {mem}")
    return t


def _arena_line(s: dict[str, Any]) -> Any:
    from rich.text import Text

    a = s["arena"]
    t = Text()
    t.append("Arena ", style="bold")
    t.append(f"{format_bytes(a['committed_bytes'])} committed of {format_bytes(a['capacity_bytes'])} "
             f"({a['capacity_source']})  free {format_bytes(a['free_bytes'])}  "
             f"peak in flight {format_bytes(a['peak_in_flight_bytes'])}  queued {a['queued_jobs']}")
    if a["queue"]:
        t.append(f" ({', '.join(a['queue'][:5])}{', ...' if len(a['queue']) > 5 else ''})")
    return t


def _arena_bar(s: dict[str, Any], colors: dict[str, str], width: int) -> Any:
    """The arena, in offset order: each lane's jobs (persistent + staged bytes), the lane's
    shared ephemeral region (░), and free space (·). A used segment gets at least one cell,
    so a job of a few KiB in a GiB arena is still visible."""
    from rich.text import Text

    a, jobs = s["arena"], {j["name"]: j for j in s["jobs"]}
    cap = max(a["capacity_bytes"], 1)
    segments: list[tuple[str, int, str]] = []  # (char, bytes, style); char " " marks free space
    cursor = 0
    for lane in sorted(s["lanes"], key=lambda ln: ln["offset_bytes"]):
        if lane["size_bytes"] == 0:
            continue
        if lane["offset_bytes"] > cursor:
            segments.append((" ", lane["offset_bytes"] - cursor, "dim"))
        members = [jobs[n] for n in lane["jobs"] if n in jobs and n not in lane["swapped_jobs"]]
        for j in members:
            b = (j["persistent_bytes"] or 0) + (j["staging_bytes"] or 0)
            segments.append(("█", b, colors.get(j["name"], "white")))
        first = colors.get(members[0]["name"], "white") if members else "white"
        segments.append(("░", lane["ephemeral_bytes"], first))
        cursor = lane["offset_bytes"] + lane["size_bytes"]
    if cap > cursor:
        segments.append((" ", cap - cursor, "dim"))
    used = [max(1, round(b / cap * width)) if c != " " and b > 0 else 0 for c, b, _ in segments]
    while sum(used) > width and max(used) > 1:  # too many small jobs: shrink the largest
        used[used.index(max(used))] -= 1
    free_cells = max(width - sum(used), 0)
    free_bytes = sum(b for c, b, _ in segments if c == " ") or 1
    cells = [u if c != " " else round(b / free_bytes * free_cells) for (c, b, _), u in zip(segments, used)]
    t = Text("[")
    for (char, _, style), n in zip(segments, cells):
        t.append(("·" if char == " " else char) * n, style=style)
    t.append("]\n")
    for name, j in jobs.items():
        if j["lane"] is not None and j["status"] not in ("done", "failed", "cancelled"):
            t.append("■", style=colors.get(name, "white"))
            t.append(f" {name} {format_bytes((j['persistent_bytes'] or 0) + (j['staging_bytes'] or 0))}  ")
    t.append("░ ephemeral  · free", style="dim")
    return t


# Columns that narrow terminals leave out: (header, narrowest width that shows it).
_WIDE, _MEDIUM = 130, 100


def _lanes_table(s: dict[str, Any], width: int) -> Any:
    from rich.table import Table
    from rich.text import Text

    columns = [("lane", 0, lambda ln: str(ln["id"])),
               ("offset", _WIDE, lambda ln: format_bytes(ln["offset_bytes"])),
               ("size", 0, lambda ln: format_bytes(ln["size_bytes"])),
               ("persistent", _MEDIUM, lambda ln: format_bytes(ln["persistent_bytes"])),
               ("ephemeral", _MEDIUM, lambda ln: format_bytes(ln["ephemeral_bytes"])),
               ("E peak", _WIDE, lambda ln: format_bytes(ln["ephemeral_peak_bytes"])),
               ("in use", 0, lambda ln: format_bytes(ln["in_use_bytes"])),
               ("in flight", 0, lambda ln: str(ln["steps_in_flight"]))]
    columns = [c for c in columns if width >= c[1]]
    table = Table(title="Lanes", title_justify="left")
    for header, _, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("jobs")
    for lane in s["lanes"]:
        table.add_row(*(cell(lane) for _, _, cell in columns), Text(", ".join(lane["jobs"])))
    if not s["lanes"]:
        table.add_row("-", *[""] * (len(columns) - 1), Text("(no lanes: no job is admitted)"))
    return table


def _jobs_table(v: View, ui: UI, colors: dict[str, str], width: int) -> Any:
    from rich.table import Table
    from rich.text import Text

    from xshare.cli.render import STATUS_STYLE, fmt_number, fmt_seconds, pick_loss

    def metric(j: dict[str, Any]) -> Text:
        loss = pick_loss(j["metrics"])
        if loss is None:
            return Text("-")
        return Text(fmt_number(loss[1]) if loss[0] == "loss" else f"{loss[0]} {fmt_number(loss[1])}")

    jobs = ordered_jobs(v.status, ui.sort)
    any_error = any(j["error"] for j in jobs)
    columns = [
        ("job", 0, "left", lambda j: Text(j["name"], style=colors.get(j["name"], ""))),
        ("status", 0, "left", lambda j: Text(j["status"], style=STATUS_STYLE.get(j["status"], ""))),
        ("lane", 0, "right", lambda j: "-" if j["lane"] is None else str(j["lane"])),
        ("prio", _MEDIUM, "right", lambda j: str(j["priority"])),
        ("steps", 0, "right",
         lambda j: f"{j['steps_done']}/{'?' if j['steps_total'] is None else j['steps_total']}"),
        ("steps/s", 0, "right", lambda j: _na(j["steps_per_s"], lambda x: f"{x:.1f}")),
        ("p50", _MEDIUM, "right", lambda j: _na(j["step_time_p50_s"], _fmt_step_time)),
        ("p95", _WIDE, "right", lambda j: _na(j["step_time_p95_s"], _fmt_step_time)),
        ("share", 0, "right", lambda j: _na(j["device_time_share"], lambda x: f"{100 * x:.0f}%")),
        ("P+S", _MEDIUM, "right",
         lambda j: _na(j["persistent_bytes"], lambda b: format_bytes(b + (j["staging_bytes"] or 0)))),
        ("E", _WIDE, "right", lambda j: _na(j["ephemeral_bytes"], format_bytes)),
        ("wait", _WIDE, "right", lambda j: _na(j["queue_wait_s"], fmt_seconds)),
        ("metric", 0, "left", metric),
        ("error", 0 if any_error else _WIDE, "left", lambda j: Text(j["error"] or "")),
    ]
    columns = [c for c in columns if width >= c[1]]
    table = Table(title=f"Jobs (sorted by {ui.sort})", title_justify="left")
    table.add_column(" ", no_wrap=True, width=1)
    for header, _, justify, _ in columns:
        if header == "error":
            table.add_column(header, overflow="ellipsis", no_wrap=True, max_width=60)
        else:
            table.add_column(header, justify=justify, no_wrap=True)
    for j in jobs:
        selected = ui.live and ui.selected == (v.target.address, j["name"])
        table.add_row(Text("▶" if selected else ""), *(cell(j) for _, _, _, cell in columns),
                      style="reverse" if selected else None)
    return table


def _fmt_step_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f}µs"
    if s < 1:
        return f"{s * 1e3:.1f}ms"
    return f"{s:.2f}s"


# ------------------------------------------------------------------------------------- live mode

class KeyReader:
    """Reads keys from a terminal in cbreak mode on a daemon thread: ``get(timeout)`` returns
    "q", "p", "s", "up", "down" (and other single characters), or None on timeout. Restores
    the terminal on exit. Without a terminal on stdin it reads nothing (Ctrl-C still quits)."""

    _SEQUENCES = {b"\x1b[A": "up", b"\x1bOA": "up", b"\x1b[B": "down", b"\x1bOB": "down"}

    def __init__(self, stream: Any = None):
        self._stream = stream if stream is not None else sys.stdin
        self._keys: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._saved: Any = None
        self._thread: threading.Thread | None = None
        self._fd: int | None = None

    def __enter__(self) -> "KeyReader":
        try:
            fd = self._stream.fileno()
            isatty = os.isatty(fd)
        except (AttributeError, OSError, ValueError):
            return self
        if not isatty:
            return self
        import termios
        import tty

        self._fd = fd
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)  # keys arrive one at a time, unechoed; Ctrl-C still interrupts
        self._thread = threading.Thread(target=self._read, name="xshare-top-keys", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def get(self, timeout: float) -> str | None:
        try:
            return self._keys.get(timeout=max(timeout, 0))
        except queue.Empty:
            return None

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(self._fd, 64)
            except (OSError, ValueError):
                return
            if not data:
                return
            for key in self.parse(data):
                self._keys.put(key)

    @classmethod
    def parse(cls, data: bytes) -> list[str]:
        keys, i = [], 0
        while i < len(data):
            for seq, name in cls._SEQUENCES.items():
                if data.startswith(seq, i):
                    keys.append(name)
                    i += len(seq)
                    break
            else:
                if data[i] == 0x1B:  # another escape sequence: skip it whole
                    i += 1
                    while i < len(data) and not (0x40 <= data[i] <= 0x7E and data[i] not in b"[O"):
                        i += 1
                    i += 1
                    continue
                keys.append({"k": "up", "j": "down"}.get(chr(data[i]), chr(data[i]).lower()))
                i += 1
        return keys


def _live(args: argparse.Namespace) -> int:
    from rich.live import Live

    from xshare.cli.render import console

    interval = args.interval if args.interval is not None else 1.0
    ui = UI(live=True)
    con = console()
    refreshes = 0
    try:
        with KeyReader() as keys, Live(console=con, screen=True, auto_refresh=False,
                                       redirect_stdout=False, redirect_stderr=False) as live:
            views = fetch_all(find_targets(args))
            next_fetch = time.monotonic() + interval
            while True:
                order = selectable(views, ui.sort)
                if ui.selected not in order:
                    ui.selected = order[0] if order else None
                live.update(render(views, ui, con.width), refresh=True)
                key = keys.get(next_fetch - time.monotonic())
                if key is None:
                    refreshes += 1
                    if args.iterations is not None and refreshes >= args.iterations:
                        return EXIT_OK
                    views = fetch_all(find_targets(args))
                    next_fetch = time.monotonic() + interval
                    continue
                if key == "q":
                    return EXIT_OK
                if key in ("up", "down") and order:
                    i = order.index(ui.selected) if ui.selected in order else 0
                    ui.selected = order[(i + (1 if key == "down" else -1)) % len(order)]
                elif key == "s":
                    ui.sort = SORT_KEYS[(SORT_KEYS.index(ui.sort) + 1) % len(SORT_KEYS)]
                elif key == "p" and ui.selected is not None:
                    ui.message = _toggle_pause(views, ui.selected)
                    views = fetch_all(find_targets(args))  # show the effect at once
    except KeyboardInterrupt:
        return EXIT_OK


def _toggle_pause(views: list[View], selected: tuple[str, str]) -> str:
    address, name = selected
    for v in views:
        if v.target.address != address or v.status is None:
            continue
        job = next((j for j in v.status["jobs"] if j["name"] == name), None)
        if job is None:
            return f"{name}: gone"
        if job["status"] in ("done", "failed", "cancelled"):
            return f"{name} is {job['status']}; nothing to pause"
        if not v.target.token:
            return (f"no token for {address}: pass --token, or run xshare top as the user who "
                    "started the runtime (its discovery file holds the token)")
        action = "resume" if job["paused"] or job["status"] == "paused" else "pause"
        try:
            control(v.target, name, action)
        except RuntimeError as err:
            return f"{action} {name}: {err}"
        return f"{action}d {name}"
    return f"{address}: not reachable"


__all__ = ["add_arguments", "run", "render", "fetch_status", "control", "find_targets", "KeyReader"]
