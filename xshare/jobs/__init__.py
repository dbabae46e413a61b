"""Jobs as plain data, and the launch specs that describe them: a TOML file or ``module:function --set k=v1,v2`` expanded into a list of jobs.

A spec names factories (``module:function``) and the parameters to call them with. Lists
under ``params`` expand to a grid, the cartesian product of every list (like Hydra multirun),
and ``replicas = N`` runs each grid point N times. Everything here is checked before any job
starts: every problem is a :class:`xshare.SpecError` whose message names the job and the fix.

Rules a user relies on (also in the README):

* ``replicas = N`` passes ``seed = 0 .. N-1`` to the factory, unless ``params`` sets ``seed``
  itself: then the N replicas are identical copies (useful to measure sharing), named
  ``replica=i``.
* To pass a list as one value instead of sweeping it, wrap it in another list:
  ``layers = [[128, 64]]``.
* Job names are ``{num}_{k=v,...}``: ``num`` counts every job of the run from 0, zero-padded
  to the width of the count; ``k=v`` lists the swept parameters (sorted by key, plus ``seed``
  or ``replica`` when ``replicas > 1``). A job table's ``name`` goes first: ``{num}_{name}_...``.
  With nothing swept and no name, the label is the entry's module name.
* ``steps`` is passed to the factory as ``steps=`` when it takes that parameter, and is set on
  the returned job in any case; ``priority`` is set on the returned job.

The package splits along the things a spec goes through: :mod:`.parse` (the TOML and
``--set`` values, the plan's data model), :mod:`.expand` (the grid, names, the plan),
:mod:`.resolve` (from ``module:function`` to the factory) and :mod:`.factory` (the factory's
call: the bound job); :mod:`.search` reads the search spaces of ``xshare tune``. Planning
imports no jax; only :func:`build` calls the factories.

One job is one type, :class:`JobRequest` (:mod:`.request`): a plan's expanded jobs, what
``xshare submit`` and the control API send, what the Ray actors and the benchmarks' child
processes receive (``PlannedJob`` is the same class under its old name).

This package sits below everything that starts jobs (the CLI, the service, tune, the
benchmarks and Ray all import it) and imports none of them: the layer contract in
pyproject.toml (``[tool.importlinter]``) keeps it so.
"""

from __future__ import annotations

from xshare._errors import SpecError as SpecError

from .expand import plan_entry as plan_entry
from .expand import plan_file as plan_file
from .expand import plan_target as plan_target
from .expand import requests_from_plan as requests_from_plan
from .factory import build as build
from .factory import build_all as build_all
from .parse import JOB_KEYS as JOB_KEYS
from .parse import RUNTIME_KEYS as RUNTIME_KEYS
from .parse import TOP_KEYS as TOP_KEYS
from .parse import LaunchPlan as LaunchPlan
from .parse import Overrides as Overrides
from .parse import PlannedJob as PlannedJob
from .parse import RuntimeOptions as RuntimeOptions
from .parse import parse_set as parse_set
from .parse import parse_value as parse_value
from .parse import plan_from_json as plan_from_json
from .parse import policies as policies
from .request import JobRequest as JobRequest
from .request import RequestError as RequestError
from .resolve import check_params as check_params
from .resolve import resolve_entry as resolve_entry
from .resolve import signature as signature
