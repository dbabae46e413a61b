"""``xshare top``: what the running runtimes are doing, from their ``/status`` endpoints.

It finds runtimes through their discovery files (or ``--address``), asks each for ``/status``
and draws: a header and device line per runtime, the arena as a bar split per job with its
free space, a lanes table and a jobs table. Live mode redraws every ``--interval`` seconds and
reads keys on a thread (cbreak mode): ``q`` quits, ``↑``/``↓`` select a job, ``p`` pauses or
resumes it (with the token from the runtime's discovery file or ``--token``), ``s`` cycles the
sort key. ``--once`` prints one rendering; ``--json`` prints the status itself (NDJSON, one
line per refresh, with ``--interval``). Off a terminal it behaves like ``--once``.

A client of the HTTP API only: it never imports jax nor touches a device, so it starts in a
fraction of a second (benchmarks/RESULTS.md). The package splits along :mod:`.fetch` (where
the data comes from), :mod:`.model` (the live view's state and keys) and :mod:`.render`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from .fetch import Target, View, control, fetch_all, fetch_status, find_targets, none_found, schema_errors
from .model import SORT_KEYS, UI, KeyReader, apply_key, selectable
from .render import render

EXIT_OK, EXIT_NONE = 0, 1


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
    parser.add_argument("--ray", action="store_true",
                        help="show every runtime actor of a Ray cluster (xshare launch --ray); --address is then "
                             "Ray's (default 'auto'). Needs pip install 'xshare[ray]'")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 seconds")
    return value


def _none_found(args: argparse.Namespace, views: Sequence[View] = ()) -> int:
    print(f"xshare top: {none_found(args, views)}", file=sys.stderr)
    return EXIT_NONE


def run(args: argparse.Namespace) -> int:
    if getattr(args, "ray", False):
        return _ray(args)
    targets = find_targets(args)
    if not targets:
        return _none_found(args)
    if args.json:
        return _json(args)
    if args.once or not sys.stdout.isatty():
        views = fetch_all(targets)
        if not any(v.status for v in views):
            if not args.address:
                for v in views:
                    print(f"xshare top: {v.target.address}: {v.error}", file=sys.stderr)
            return _none_found(args, views)
        from xshare.cli.render import console

        con = console()
        try:
            screen = render(views, UI(), con.width)
        except (KeyError, TypeError, ValueError) as err:  # a document we cannot draw: say why
            bad = [f"{v.target.address}: {e}" for v in views if v.status for e in schema_errors(v.status)]
            print(f"xshare top: cannot draw the status ({type(err).__name__}: {err}); "
                  f"{'; '.join(bad) or 'it follows the schema, so this is a bug in xshare top'}", file=sys.stderr)
            return EXIT_NONE
        con.print(screen)
        return EXIT_OK
    return _live(args)


def _ray(args: argparse.Namespace) -> int:
    """One rendering (or JSON document) of every runtime actor's status, asked through Ray."""
    from xshare._errors import XShareError
    from xshare.service.ray_actors import actor_snapshots

    try:
        docs = actor_snapshots(args.address)
    except XShareError as err:
        print(f"xshare top: {err}", file=sys.stderr)
        return EXIT_NONE
    except Exception as err:  # noqa: BLE001 - Ray's message names the address and why
        print(f"xshare top: cannot reach Ray at {args.address or 'auto'}: {err}", file=sys.stderr)
        return EXIT_NONE
    if not docs:
        print("xshare top: no xshare runtime actor in this Ray cluster (start a sweep with xshare launch --ray)",
              file=sys.stderr)
        return EXIT_NONE
    if args.json:
        print(json.dumps({"runtimes": docs}, indent=2))
        return EXIT_OK
    from xshare.cli.render import console

    con = console()
    con.print(render([View(Target(d["actor"]), status=d) for d in docs], UI(), con.width))
    return EXIT_OK


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
        ok = [v.status for v in views if v.status is not None]
        if not ok:
            return EXIT_OK if printed else _none_found(args, views)
        for v in views:
            if v.error:
                print(f"xshare top: {v.target.address}: {v.error}", file=sys.stderr)
        doc = ok[0] if len(ok) == 1 else {"runtimes": ok}
        if args.interval is None:
            print(json.dumps(doc, indent=2))
            return EXIT_OK
        print(json.dumps(doc), flush=True)
        printed += 1
        if args.iterations is not None and printed >= args.iterations:
            return EXIT_OK
        time.sleep(args.interval)


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
                elif key == "q":
                    return EXIT_OK
                elif apply_key(ui, key, views):
                    views = fetch_all(find_targets(args))
    except KeyboardInterrupt:
        return EXIT_OK


__all__ = ["add_arguments", "run", "render", "fetch_status", "control", "find_targets", "KeyReader",
           "Target", "View", "UI", "SORT_KEYS"]
