"""Launch specs, kept importable under their old name: the spec model is :mod:`xshare.jobs`
(jobs as plain data, below the CLI, the service, tune and the benchmarks, which all import it).

``xshare.cli.spec.parse`` (``.expand``, ``.resolve``, ``.search``) are the same module objects
as ``xshare.jobs.parse`` and so on, so patching one patches the other.
"""

from __future__ import annotations

import sys

from xshare.jobs import JOB_KEYS as JOB_KEYS
from xshare.jobs import RUNTIME_KEYS as RUNTIME_KEYS
from xshare.jobs import TOP_KEYS as TOP_KEYS
from xshare.jobs import LaunchPlan as LaunchPlan
from xshare.jobs import Overrides as Overrides
from xshare.jobs import PlannedJob as PlannedJob
from xshare.jobs import RuntimeOptions as RuntimeOptions
from xshare.jobs import SpecError as SpecError
from xshare.jobs import build as build
from xshare.jobs import build_all as build_all
from xshare.jobs import check_params as check_params
from xshare.jobs import expand as expand
from xshare.jobs import parse as parse
from xshare.jobs import parse_set as parse_set
from xshare.jobs import parse_value as parse_value
from xshare.jobs import plan_entry as plan_entry
from xshare.jobs import plan_file as plan_file
from xshare.jobs import plan_from_json as plan_from_json
from xshare.jobs import policies as policies
from xshare.jobs import resolve as resolve
from xshare.jobs import resolve_entry as resolve_entry
from xshare.jobs import search as search
from xshare.jobs import signature as signature

# `from xshare.cli.spec.parse import X` keeps working: the submodules are the same objects.
for _name, _module in {"parse": parse, "expand": expand, "resolve": resolve, "search": search}.items():
    sys.modules[f"{__name__}.{_name}"] = _module
