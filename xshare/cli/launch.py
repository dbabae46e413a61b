"""``xshare launch``: expand a spec, run its jobs in one runtime, show progress, summarize.

Thin by design: :mod:`xshare.jobs` checks and expands, ``xshare.Runtime`` runs, and
:mod:`xshare.cli.render` draws. Exit codes: 0 all jobs done, 1 a job failed or was cancelled,
2 the spec (or the command line) is wrong and nothing was started (no directory is left
behind), 130 interrupted by SIGINT or SIGTERM at any moment (steps in flight finish, every
unfinished job is checkpointed; a second signal only prints a note), -9 SIGKILL (the last
checkpoints stay valid). Either way ``--resume RUN_DIR`` continues.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from xshare.cli.launch_plan import plan as _plan, print_fusion as _print_fusion  # the dry run
from xshare.cli.launch_summary import summary as _summary  # the closing table
from xshare.cli.rundir import (  # EXIT_* are launch's public exit codes too
    EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE, check_out as _check_out,
    check_ports as _check_ports, cwd_on_path as _cwd_on_path, make_run_dir as _make_run_dir,
    resolved as _resolved, usage_error as _usage_error)
_POLL_S = 0.25  # how long each rt.wait() blocks; the live table redraws about 4 times a second
_PLAIN_EVERY_S = 5.0  # off a terminal: one line per job this often


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", nargs="?", metavar="SPEC.toml | module:function",
        help="a TOML launch spec, or a factory returning a bound job",
    )
    parser.add_argument("--policy", help="fifo, pack, srtf, fair or priority (overrides [runtime] policy)")
    parser.add_argument(
        "--memory", help="device memory the runtime may use: bytes, '2GiB', or 'device' (overrides [runtime] memory)"
    )
    parser.add_argument(
        "--quantum", type=int, help="steps a job runs before the policy picks again (overrides [runtime] quantum)"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="K=V[,V...]",
        help="a factory parameter; a comma list sweeps it. Values parse as int, float, bool, else string. Repeatable",
    )
    parser.add_argument("--replicas", type=int, help="runs per grid point, with seed=0..N-1 unless seed is set")
    parser.add_argument("--steps", type=int, help="steps per job (overrides the spec's steps)")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/{YYYYmmdd-HHMMSS}-{spec name})")
    parser.add_argument("--dry-run", action="store_true", help="print the expanded jobs and exit without running "
                        "(with --fuse: compile them and print the fused groups, and why a job cannot join one)")
    parser.add_argument("--fuse", action="store_true",
                        help="run jobs that share a program as fused groups: one vmapped executable for "
                             "all of them, each still its own job (overrides [runtime] fuse)")
    parser.add_argument(
        "--resume", metavar="RUN_DIR",
        help="continue an interrupted launch: every unfinished job restarts from its last checkpoint",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=100, metavar="N",
        help="checkpoint each job every N steps, at its end and on Ctrl-C/SIGTERM (default 100; 0 = only on exit)",
    )
    parser.add_argument(
        "--checkpoint-keep", type=int, default=3, metavar="K",
        help="keep each job's newest K checkpoints (Orbax's max_to_keep; default 3)",
    )
    parser.add_argument(
        "--status-port", type=int, default=0, metavar="PORT",
        help="serve /status and /metrics on 127.0.0.1:PORT for xshare top (default 0 = any free port; -1 = off)",
    )
    from xshare.cli import launch_ray  # --ray, --address, --actors: the sweep across Ray actors

    launch_ray.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    global _INTERRUPTS
    with _Interrupts() as _INTERRUPTS:
        try:
            code = _launch(args)
        except KeyboardInterrupt:  # before the runtime existed (or while it was refusing)
            print("xshare launch: interrupted", file=sys.stderr)
            code = EXIT_INTERRUPTED
        if _INTERRUPTS.fired:
            if code != EXIT_INTERRUPTED:  # noticed at the end: the work is done and saved
                print("xshare launch: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        return code


def _launch(args: argparse.Namespace) -> int:
    from xshare._errors import SpecError
    from xshare.cli import render
    from xshare import jobs as specs

    out = render.console()
    _cwd_on_path()
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        return _usage_error(f"--checkpoint-every {args.checkpoint_every} must be >= 0")
    if getattr(args, "checkpoint_keep", 3) < 1:
        return _usage_error(f"--checkpoint-keep {args.checkpoint_keep} must be >= 1")
    problem = _check_ports(args.status_port)
    if problem:
        return _usage_error(problem)
    if args.resume:
        return _resume(args, out)
    if not args.target:
        return _usage_error("give a spec (SPEC.toml), an entry point (module:function), or --resume RUN_DIR")
    try:
        plan = _plan(args, specs)
        if args.dry_run:
            out.print(render.plan_table(plan))
            if plan.runtime.fuse:
                _print_fusion(specs.build_all(plan), out, plan.runtime.policy)
            return EXIT_OK
        if getattr(args, "ray", False):  # the runtime actors build the jobs, not this process
            from xshare.cli import launch_ray
            _INTERRUPTS.raising = True  # Ctrl-C raises KeyboardInterrupt in the Ray driver, as before

            return launch_ray.run(plan, args)
        jobs = specs.build_all(plan)  # calls every factory before anything runs
    except SpecError as err:
        return _usage_error(str(err))
    _interrupted()
    problem = _check_out(args.out)
    if problem:
        return _usage_error(problem)
    try:
        run_dir, made = _make_run_dir(args.out, plan.stem)
    except OSError as err:
        return _usage_error(f"cannot create the run directory: {err}")
    code = EXIT_USAGE
    try:
        (run_dir / "spec.json").write_text(json.dumps(_resolved(plan, run_dir), indent=2, default=str) + "\n")
        code = _run(plan, jobs, run_dir, out, args)
    finally:
        if code == EXIT_USAGE:  # refused (or failed before running): leave nothing behind
            made.undo()
    return code


def _resume(args: argparse.Namespace, out: Any) -> int:
    from xshare._errors import SpecError
    from xshare import jobs as specs

    run_dir = Path(args.resume)
    record = run_dir / "spec.json"
    if not record.is_file():
        return _usage_error(f"--resume {args.resume}: no spec.json there; give a run directory made by xshare launch")
    try:
        plan = specs.plan_from_json(json.loads(record.read_text()), str(record))
        jobs = specs.build_all(plan)
    except (SpecError, ValueError) as err:
        return _usage_error(str(err))
    except (KeyError, TypeError, AttributeError) as err:  # a spec.json edited by hand
        what = f"lacks {err.args[0]!r}" if isinstance(err, KeyError) else f"is malformed ({err})"
        return _usage_error(f"--resume {args.resume}: a job in {record} {what}; it is not a spec.json "
                            "as xshare launch writes it: restore that field or start a new launch")
    return _run(plan, jobs, run_dir, out, args, resume=True)


def _run(plan: Any, jobs: list[Any], run_dir: Path, out: Any, args: argparse.Namespace,
         resume: bool = False) -> int:
    import xshare
    from xshare._errors import AdmissionError, XShareError
    from xshare.cli import render

    rt_opts = plan.runtime
    out.print(
        f"xshare: {len(jobs)} job(s), policy {rt_opts.policy}, "
        f"memory {'device' if rt_opts.memory is None else rt_opts.memory}, quantum {rt_opts.quantum} -> {run_dir}",
        markup=False,
        highlight=False,
    )
    start = time.monotonic()
    # XLA's persistent compilation cache: a relaunch of the same sweep compiles nothing.
    from xshare.runtime.compiled.compiler import enable_persistent_cache
    from xshare.runtime.web.discovery import clean_stale
    cache_dir = enable_persistent_cache()
    clean_stale()  # discovery files of launches that were killed (SIGKILL leaves its file)
    _interrupted()
    try:
        # checkpoint_dir given: every job checkpoints when it ends and on stop(), so
        # --checkpoint-every 0 ("only on exit") still leaves something to resume from.
        from xshare.runtime.observe import writers  # TensorBoard event files when the extra is there
        rt = xshare.Runtime(
            **rt_opts.as_kwargs(), log_dir=str(run_dir), checkpoint_dir=str(run_dir),
            checkpoint_every=args.checkpoint_every or None, resume=resume, writers=writers.defaults(),
            checkpoint_keep=getattr(args, "checkpoint_keep", 3),
            status_port=None if args.status_port < 0 else args.status_port)
    except (ValueError, XShareError) as err:
        return _usage_error(f"cannot start the runtime: {err}")
    handles: list[Any] = []
    first_seen: dict[str, dict[str, float]] = {}
    code = EXIT_OK
    try:
        try:
            handles = _submit(rt, jobs)
        except AdmissionError as err:  # it names the job, its footprint, the arena and the fix
            return _usage_error(f"{err}. Nothing was run.")
        except XShareError as err:
            return _usage_error(f"the runtime refused the jobs: {err}. Nothing was run.")
        try:
            _watch(rt, handles, out, start, first_seen)  # SIGINT/SIGTERM end it (_Interrupts)
        except KeyboardInterrupt:
            # Finish the steps in flight, checkpoint every unfinished job, then stop:
            # `xshare launch --resume RUN_DIR` continues from exactly here.
            out.print("interrupted: finishing steps in flight and checkpointing ...", markup=False, highlight=False)
            rt.stop(checkpoint=True)
            out.print(f"resume with: xshare launch --resume {run_dir}", markup=False, highlight=False)
            code = EXIT_INTERRUPTED
    except KeyboardInterrupt:  # while compiling: nothing has run yet
        return EXIT_INTERRUPTED
    finally:
        rt.close()
    rows = [_summary(h, run_dir, first_seen) for h in handles]
    refused = [h for h in handles if isinstance(h.exception, AdmissionError)]
    if refused and len(refused) == len(handles):
        # Footprints are known once compiled (submit returns at once): no job can ever fit.
        return _usage_error(f"{refused[0].exception}. Nothing was run.")
    out.print(render.summary_table(rows, time.monotonic() - start))
    failed = [r for r in rows if r.status == "failed"]
    for r in failed:
        out.print(f"{r.name}: traceback in {run_dir / r.name / 'log.txt'}", markup=False, highlight=False)
    out.print(f"metrics: {run_dir}/<job>/metrics.jsonl", markup=False, highlight=False)
    # What compiling cost this launch (XLA's persistent cache makes a relaunch's near zero).
    out.print(f"xla: {rt.compiles} program(s) compiled in {rt.compile_s:.2f} s (cache: {cache_dir})",
              markup=False, highlight=False)
    if code == EXIT_OK and any(r.status != "done" for r in rows):
        code = EXIT_JOB_FAILED
    return code


def _submit(rt: Any, jobs: list[Any]) -> list[Any]:
    """All or nothing: ``submit_many`` compiles every job before admitting any, so an
    AdmissionError leaves nothing running and no job gets a head start from the others'
    compile time. Without it, submit one by one and cancel the earlier ones on error."""
    submit_many = getattr(rt, "submit_many", None)
    if submit_many is not None:
        return list(submit_many(jobs))
    handles: list[Any] = []
    try:
        for job in jobs:
            handles.append(rt.submit(job))
    except BaseException:
        _cancel(handles)
        raise
    return handles


def _watch(rt: Any, handles: list[Any], out: Any, start: float, first_seen: dict[str, dict[str, float]]) -> None:
    from rich.live import Live

    from xshare.cli import render

    def snapshot() -> list[Any]:
        rows = [h.progress() for h in handles]
        for p in rows:
            if p.metrics and p.name not in first_seen:
                first_seen[p.name] = dict(p.metrics)
        return rows

    if out.is_terminal:
        with Live(render.progress_table(snapshot(), 0.0), console=out, refresh_per_second=4, transient=True) as live:
            while not rt.wait(timeout=_POLL_S):
                _interrupted()
                live.update(render.progress_table(snapshot(), time.monotonic() - start))
        return
    next_line = start + _PLAIN_EVERY_S
    while not rt.wait(timeout=_POLL_S):
        _interrupted()
        now = time.monotonic()
        if now >= next_line:
            for p in snapshot():
                print(render.progress_line(p, now - start), file=out.file, flush=True)
            next_line = now + _PLAIN_EVERY_S
        else:
            snapshot()


class _Interrupts:
    """SIGINT and SIGTERM (a scheduler preempting the launch), at any moment of the launch, end
    it with exit 130 and no traceback; later ones only print a note, so the graceful stop that
    follows (finish steps in flight, checkpoint) completes, JAX's exit handlers included.

    The handler only records the signal: the launch checks it at safe points (between phases,
    and every poll of the progress loop, where it raises KeyboardInterrupt). A KeyboardInterrupt
    raised at an arbitrary bytecode can land in JAX's gc callback (where it is swallowed: the
    launch ran on) or in a C extension's import (seen to crash with SIGSEGV). ``raising=True``
    (the Ray driver) raises from the handler as Python does by default. Off the main thread (a
    test calling ``run``) the handlers are left alone."""

    def __init__(self) -> None:
        self.fired, self.raising = False, False

    def __enter__(self) -> "_Interrupts":
        import signal

        self._signal, self._old, self.fired = signal, {}, False
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                break
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if self.fired:
            print("xshare launch: already stopping (finishing steps in flight and checkpointing); "
                  "SIGKILL stops at once and loses the steps since the last checkpoint",
                  file=sys.stderr, flush=True)
            return
        self.fired = True
        if self.raising:
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        if not self.fired:  # after an interrupt the process is exiting: keep ignoring signals
            for sig, old in self._old.items():
                self._signal.signal(sig, old)


_INTERRUPTS = _Interrupts()  # the current launch's (run() replaces it)


def _interrupted() -> None:
    """Raise KeyboardInterrupt (on the main thread, at a safe point) once SIGINT/SIGTERM came."""
    if _INTERRUPTS.fired:
        raise KeyboardInterrupt



def _cancel(handles: list[Any]) -> None:
    for h in handles:
        cancel = getattr(h, "cancel", None)
        if cancel is not None:
            try:
                cancel()
            except Exception:  # noqa: BLE001 - already finished, or the runtime is going down: nothing to undo
                pass
