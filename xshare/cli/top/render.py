"""Drawing ``xshare top``: a header and device line per runtime, the arena as a bar split per
job with its free space, a lanes table and a jobs table. Pure functions of the status documents
(and the UI state); ``width`` (the console's) decides which columns the tables keep."""

from __future__ import annotations

from typing import Any, Callable

from xshare._units import format_bytes

from .fetch import View
from .model import UI, ordered_jobs

_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
            "bright_green", "bright_yellow", "bright_blue", "bright_red")


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
        if s.get("models"):
            parts.append(_models_table(s))
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

    assert v.status is not None  # (render draws a view's tables only when it has a status)
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
    """The arena, lane by lane (in offset order where a runtime reports offsets): each lane's jobs (persistent + staged bytes), the lane's
    shared ephemeral region (░), and free space (·). A used segment gets at least one cell,
    so a job of a few KiB in a GiB arena is still visible."""
    from rich.text import Text

    a, jobs = s["arena"], {j["name"]: j for j in s["jobs"]}
    cap = max(a["capacity_bytes"], 1)
    segments: list[tuple[str, int, str]] = []  # (char, bytes, style); char " " marks free space
    cursor = 0
    for lane in sorted(s["lanes"], key=lambda ln: (ln.get("offset_bytes", 0), ln["id"])):
        if lane["size_bytes"] == 0:
            continue
        offset = lane.get("offset_bytes", cursor)  # lanes are reservations: no offsets in newer runtimes
        if offset > cursor:
            segments.append((" ", offset - cursor, "dim"))
        members = [jobs[n] for n in lane["jobs"] if n in jobs and n not in lane["swapped_jobs"]]
        for j in members:
            b = (j["persistent_bytes"] or 0) + (j["staging_bytes"] or 0)
            segments.append(("█", b, colors.get(j["name"], "white")))
        first = colors.get(members[0]["name"], "white") if members else "white"
        segments.append(("░", lane["ephemeral_bytes"], first))
        cursor = offset + lane["size_bytes"]
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
               ("offset", _WIDE if any("offset_bytes" in ln for ln in s["lanes"]) else 10**9,
                lambda ln: format_bytes(ln["offset_bytes"])),
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
        text = fmt_number(loss[1]) if loss[0] == "loss" else f"{loss[0]} {fmt_number(loss[1])}"
        # The newest evaluation's first metric too (bind(..., eval_step=...)): what a sweep is judged by.
        ev = next(((k, v) for k, v in (j["metrics"] or {}).items() if k.startswith("eval/")), None)
        if ev is not None and ev[0] != loss[0]:
            text += f" {ev[0]} {fmt_number(ev[1])}"
        return Text(text)

    assert v.status is not None  # (as in _header)
    jobs = ordered_jobs(v.status, ui.sort)
    any_error = any(j["error"] for j in jobs)
    # (header, narrowest width that shows it, rich's justify, the cell of a job)
    columns: list[tuple[str, int, Any, Callable[[dict[str, Any]], Any]]] = [
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


def _models_table(s: dict[str, Any]) -> Any:
    """Deployed models: load (requests/s), queue depth, batch fill and request latency."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Models (Open Inference Protocol: /v2/models/NAME)", title_justify="left")
    for header in ("model", "status", "lane", "prio", "req/s", "queue", "fill", "p50", "p99", "requests",
                   "errors", "503s", "P", "E"):
        table.add_column(header, justify="left" if header in ("model", "status") else "right", no_wrap=True)
    for m in s["models"]:
        label = m["name"] if m.get("version", 1) == 1 else f"{m['name']} v{m['version']}"  # a later version
        table.add_row(Text(label, style="bold"), m["status"], _na(m["lane"], str), str(m["priority"]),
                      f"{m['requests_per_s']:.1f}", str(m["queue_rows"]),
                      _na(m["batch_fill"], lambda x: f"{100 * x:.0f}%"),
                      _na(m["latency_p50_s"], _fmt_step_time), _na(m["latency_p99_s"], _fmt_step_time),
                      str(m["requests_total"]), str(m["errors_total"]), str(m["rejected_total"]),
                      format_bytes(m["persistent_bytes"]), format_bytes(m["ephemeral_bytes"]))
    return table
