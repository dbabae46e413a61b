"""``xshare bench``: xshare against exclusive allocation and against one process per job.

The library behind ``xshare bench`` and ``benchmarks/bench_sharing.py``: workloads
(:mod:`.workloads`), the plain loop every baseline runs (:mod:`.loop`), the modes
(:mod:`.modes`), the measured processes (:mod:`.worker`, :mod:`.measure`), and the report
(:mod:`.report`, :mod:`.plot`), driven by :func:`run_bench`.
"""

from .modes import DEFAULT_MODES as DEFAULT_MODES
from .modes import parse_modes as parse_modes
from .runner import BenchConfig as BenchConfig
from .runner import run_bench as run_bench
from .workloads import NAMES as WORKLOADS

__all__ = ["BenchConfig", "run_bench", "parse_modes", "DEFAULT_MODES", "WORKLOADS"]
