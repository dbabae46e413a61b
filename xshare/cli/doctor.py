"""``xshare doctor``: does this machine run xshare correctly? One table, or ``--json`` for a
bug report; ``--selftest`` runs every device path once and writes a markdown report.

Thin: the checks are :mod:`xshare.cli.doctor_checks` (and the canary,
:mod:`xshare.ffi.canary`), the self-test :mod:`xshare.cli.doctor_selftest`; this parses,
calls them and renders. Exit codes: 0 every check passed (warnings allowed), 1 a check
failed (its row names the fix), 2 the command line is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim", "info": "cyan"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the whole report as one JSON object (paste it into a bug report)")
    parser.add_argument("--recheck", action="store_true",
                        help="run the fence canary again even if this machine has a cached verdict")
    parser.add_argument("--selftest", action="store_true",
                        help="also run every device path once (fences, memory figures, a fused sweep, "
                             "a served model, equivalence, throughput): about a minute on a CPU")
    parser.add_argument("--quick", action="store_true",
                        help="with --selftest: the fast subset (one zoo model, fewer steps)")
    parser.add_argument("--report", metavar="FILE.md",
                        help="with --selftest: write the markdown report to FILE.md")


def run(args: argparse.Namespace) -> int:
    if (args.quick or args.report) and not args.selftest:
        print("xshare doctor: --quick and --report go with --selftest", file=sys.stderr)
        return EXIT_USAGE
    from xshare.ffi import canary

    try:
        canary.mode()
    except ValueError as e:
        print(f"xshare doctor: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .doctor_checks import collect


    # The self-test starts runtimes as users do (preallocation and all); the plain doctor
    # starts jax without taking the GPU's memory.
    report = collect(recheck=args.recheck, preallocate=args.selftest)
    if args.selftest:
        from .doctor_selftest import run_selftest, to_markdown

        report["selftest"] = run_selftest(quick=args.quick)
        report["ok"] = report["ok"] and report["selftest"]["ok"]
        if args.report:
            with open(args.report, "w") as f:
                f.write(to_markdown(report))
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        render(report)
        if args.selftest and args.report:
            print(f"report written to {args.report}")
    return EXIT_OK if report["ok"] else EXIT_FAILED


def rows(report: dict) -> list[dict]:
    """Every check, then the self-test's, as the table shows them."""
    out = list(report["checks"])
    for c in (report.get("selftest") or {}).get("checks", []):
        out.append({"section": "selftest", "name": c["name"], "status": c["status"],
                    "summary": c["summary"], "fix": c.get("fix")})
    return out


def render(report: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    from .render import console

    con = console()
    table = Table(title="xshare doctor", title_justify="left", show_lines=False)
    for col in ("", "section", "check", "found", "fix"):
        table.add_column(col, overflow="fold")
    for c in rows(report):
        table.add_row(Text(c["status"], style=STYLE.get(c["status"], "")), Text(c["section"]),
                      Text(c["name"]), Text(c["summary"]), Text(c["fix"] or ""))
    con.print(table)
    failed = [c for c in rows(report) if c["status"] == "fail"]
    if failed:
        con.print(Text(f"{len(failed)} check(s) failed: " + "; ".join(
            f"{c['name']}: {c['fix']}" for c in failed), style="bold red"))
    else:
        con.print(Text("all checks passed" + (" (warnings above)" if any(
            c["status"] == "warn" for c in rows(report)) else ""), style="green"))
