"""Jobs as plain data, kept importable under their old name: they live in :mod:`xshare.jobs`
(:mod:`xshare.jobs.request`), below the service, tune, the CLI and Ray, which all import them."""

from __future__ import annotations

from xshare.jobs.expand import plan_target as plan_target
from xshare.jobs.expand import requests_from_plan as requests_from_plan
from xshare.jobs.request import PRIORITY_MAX as PRIORITY_MAX
from xshare.jobs.request import SCHEMA_ID as SCHEMA_ID
from xshare.jobs.request import JobRequest as JobRequest
from xshare.jobs.request import RequestError as RequestError
from xshare.jobs.request import check_priority as check_priority
from xshare.jobs.request import dumps as dumps
from xshare.jobs.request import loads as loads

__all__ = ["JobRequest", "RequestError", "requests_from_plan", "plan_target", "dumps", "loads",
           "check_priority", "PRIORITY_MAX", "SCHEMA_ID"]
