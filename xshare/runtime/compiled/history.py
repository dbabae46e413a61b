"""How often and how long each program ran on this machine, so a K-step form is weighed against
the runs that will use it, not only the one that compiles it.

A K-step program (and a fused group's) is compiled once per machine: it is kept whole beside the
compilation cache (``executables.py``) and its check's verdict too (``multistep.Verdicts``), so a
later run of the program loads and adopts it without weighing again. The tiers weighed its
compile against the steps left in *this* run only, so a form that one run could not repay was
never compiled, by any run: the hook's fused group of 8 jobs x 3000 steps saves ~70 us a group
step at K=16 (137 us against ~208 us), ~0.2 s a run, for a compile of ~0.4 s, and every rerun of
that sweep stayed at one step per call.

``HISTORY`` keeps, per candidate key (a program's; a group's names its capacity), how many
processes ran it and how many steps their jobs (or groups) that weighed a form were given, beside the compilation cache
(``run-history.json``). Those steps count with the steps left when the tiers weigh a compile
(``Tiers.consider``): the break-even rule of ski rental. Every earlier run that weighed the form
and did without it paid its saving as rent; once the rent paid and this run's steps would repay
the compile, buy it. Whatever the later runs turn out to be, none or many, the rule never spends
more than twice what the best choice in hindsight would (the compile, or the rent of the runs
there were), and a program run often enough always gets its form. A program never seen before
is weighed on this run alone, as before. Like a JIT that keeps the profile of earlier runs
(Android's ART compiles ahead what earlier runs found hot): a sweep relaunched on the same
machine gets the form its earlier runs could not pay for alone.

It counted three more runs at most, each as long as the runs so far on average, until a fresh
machine's cache showed the flaw: the hook's 8 jobs x 400 steps under fifo save ~41 us a step at
K=32 against a ~0.75 s compile estimate, and 3 x 3,200 steps (0.39 s) never repaid it, however
often the sweep ran: every run stayed at one step per call (1.25-1.46x the plain loop, against
2-2.6x on a machine whose cache had the form from a longer run). No jax.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .verdict_store import JsonTable

FILE = "run-history.json"


@dataclass(frozen=True)
class Runs:
    """A program's earlier runs on this machine: how many, and the steps they were given."""

    runs: int
    steps: int

    def expected_steps(self) -> int:
        """The steps that count with a run's own when a compile is weighed: every earlier run's
        (the rent paid so far; see the module's docstring)."""
        return max(self.steps, 0) if self.runs > 0 else 0


class RunHistory:
    """candidate key -> Runs; read from and written to ``persist``'s directory."""

    def __init__(self) -> None:
        self._table: JsonTable[str, Runs] = JsonTable(FILE, _decode, _encode)
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}   # this process's runs, by key

    def persist(self, directory: str | None) -> None:
        self._table.persist(directory)

    def get(self, key: str) -> Runs | None:
        return self._table.get(key)

    def begin(self, key: str, unit: Any, steps: int) -> int:
        """``unit`` (a job or a group) of this process runs ``key`` for ``steps`` steps: a run
        counts once per process (its first unit), and the steps of every unit once. Returns the
        steps that count with its own when a form is weighed: the runs' before this process's."""
        with self._lock:
            seen = self._seen.get(key)
            first = seen is None
            if seen is None:
                before = self._table.get(key)
                seen = self._seen[key] = _Seen(before.expected_steps() if before is not None else 0)
            if unit in seen.units:
                return seen.expected
            seen.units.add(unit)
            runs = self._table.get(key) or Runs(0, 0)
            self._table.put(key, Runs(runs.runs + first, runs.steps + max(steps, 0)))
            return seen.expected


class _Seen:
    """A key's run in this process: the steps that count with its own (read once, from the runs
    before it) and the units whose steps it counted."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.units: weakref.WeakSet[Any] = weakref.WeakSet()  # (a long-lived runtime keeps none)


def _decode(r: dict[str, Any]) -> tuple[str, Runs]:
    return str(r["program"]), Runs(int(r["runs"]), int(r["steps"]))


def _encode(key: str, runs: Runs) -> dict[str, Any]:
    return {"program": key, "runs": runs.runs, "steps": runs.steps}


HISTORY = RunHistory()
