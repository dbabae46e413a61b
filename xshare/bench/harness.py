"""The one benchmark harness: "plain loop vs processes vs xshare", measured from the outside.

Every script under ``benchmarks/`` and ``xshare bench`` use it. What it measures:

* :func:`plain_loop`: N jobs one after another, each in the fast plain loop a user writes alone
  (``jax.jit(step, donate_argnums=0)`` compiled ahead of time, metrics read one step behind):
  exclusive allocation of the device.
* :func:`threads`: the same plain loops in one thread each, started together (sharing by hand,
  no runtime: the ceiling of concurrency on this device).
* :func:`runtime`: the same specs submitted together to one ``xshare.Runtime(**kwargs)``; times
  from the public status document (``Runtime.snapshot()``) and handles.
* :func:`processes`: one Python process per job, each running the plain loop, released together
  from a start barrier once all have compiled: how users share a device today.

Each returns a :class:`Run` (makespan, per-job completion times, peak RSS where sampled).
Compilation is excluded everywhere (each job's clock starts when it starts stepping), every job
ends with its final state on the host. :func:`in_child` runs any of them in a fresh process
(its own memory, no warm caches) and samples that process's RSS.

Comparing: :func:`alternate` runs configurations in rotating order, repeat after repeat (a
shared machine drifts: compare neighbours), :func:`paired_ratios` divides repeat ``r`` by
repeat ``r``; report medians. Reporting: :func:`markdown_table`, :func:`write_results` (JSON
and markdown with the command, machine and date), :func:`machine`. :func:`time_command`
times a command line from start to exit (e.g. ``xshare top --once``).

Jobs cross process boundaries as :class:`xshare.jobs.JobRequest` (entry + params + steps:
plain data; :func:`JobPlan` makes a named one), never closures; ``python -m
xshare.bench.harness`` is the child side. Nothing here reads runtime
internals. psutil (``pip install 'xshare[bench]'``) samples memory.

This module is the one place to import it all from (``from xshare.bench import harness as h``,
then ``h.<name>``); the code lives in :mod:`xshare.bench.loops` (jobs, :class:`Run`, the
in-process configurations), :mod:`xshare.bench.isolated` (the configurations in other
processes and the child protocol) and :mod:`xshare.bench.report` (comparing and reporting).
"""

from __future__ import annotations

import sys

from .isolated import _MARK as _MARK
from .isolated import RssSampler, in_child, main, processes
from .isolated import _Child as _Child
from .isolated import _child as _child
from .isolated import _emit as _emit
from .isolated import _events as _events
from .isolated import _result as _result
from .isolated import _spawn as _spawn
from .loops import JobPlan, JobTime, PlainJob, Run, build, expand, plain_loop, runtime, threads
from .loops import _batches as _batches
from .loops import _floats as _floats
from .report import (T, alternate, command_line, fmt, machine, machine_line, markdown_row, markdown_table,
                     median, paired_ratios, parser, ratio, summary, time_command, write_results)
from .report import _git as _git
from .report import _jsonable as _jsonable
from .report import _load as _load

__all__ = [
    # jobs and the in-process configurations (loops)
    "JobPlan", "build", "expand", "JobTime", "Run", "PlainJob", "plain_loop", "threads", "runtime",
    # other processes and the child side (isolated)
    "RssSampler", "processes", "in_child", "main",
    # comparing and reporting (report)
    "T", "alternate", "median", "ratio", "paired_ratios", "summary", "time_command", "fmt",
    "markdown_row", "markdown_table", "parser", "command_line", "machine", "machine_line",
    "write_results",
]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
