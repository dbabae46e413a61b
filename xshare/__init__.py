"""xshare: many JAX jobs on one accelerator, with fast job switching and lane-partitioned memory.

The public API; everything else lives in private modules and may change.

``import xshare`` is free: it imports neither jax nor jaxlib and changes no environment
variable. Each public name is imported from its module on first use (PEP 562), so
``xshare.Runtime`` imports the runtime (and jax) the first time it is touched, and the device is
touched when a ``Runtime`` is built (which also applies XLA's preallocation settings, before the
backend starts). Read-only tools (``xshare --help``, ``xshare top``) never import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it (kept stable: these paths are part of the layout).
_LAZY: dict[str, str] = {
    # jobs (xshare._job imports jax)
    "job": "xshare._job", "Job": "xshare._job", "JobSpec": "xshare._job",
    # adapters (a module: xshare.nnx imports flax)
    "nnx": "xshare.nnx",
    # runtime
    "Runtime": "xshare.runtime.runtime", "JobHandle": "xshare.runtime.runtime",
    "run": "xshare.runtime.run",
    "Progress": "xshare.runtime.engine.records", "StepRecord": "xshare.runtime.engine.records",
    "POLICIES": "xshare.sched",
    # metric writers (TensorBoard; the protocol other trackers implement)
    "Writer": "xshare.runtime.observe.writers", "TensorBoardWriter": "xshare.runtime.observe.writers",
    # serving (xshare.serving.spec is pure Python; ModelHandle's module imports jax)
    "model": "xshare.serving.spec", "ModelSpec": "xshare.serving.spec", "InferError": "xshare.serving.spec",
    "ModelHandle": "xshare.runtime.deployed.hub",
    # memory
    "Footprint": "xshare.memory.footprint",
    # errors (pure Python)
    "XShareError": "xshare._errors", "AdmissionError": "xshare._errors",
    "FootprintUnknown": "xshare._errors", "JobFailed": "xshare._errors",
    "JobCancelled": "xshare._errors", "SpecError": "xshare._errors",
}

__all__ = [
    # jobs
    "job", "Job", "JobSpec",
    # adapters
    "nnx",
    # runtime
    "Runtime", "JobHandle", "Progress", "StepRecord", "run", "POLICIES",
    # metric writers
    "Writer", "TensorBoardWriter",
    # serving
    "model", "ModelSpec", "ModelHandle", "InferError",
    # memory
    "Footprint",
    # errors
    "XShareError", "AdmissionError", "FootprintUnknown", "JobFailed", "JobCancelled", "SpecError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xshare' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from ._errors import AdmissionError as AdmissionError
    from ._errors import FootprintUnknown as FootprintUnknown
    from ._errors import JobCancelled as JobCancelled
    from ._errors import JobFailed as JobFailed
    from ._errors import SpecError as SpecError
    from ._errors import XShareError as XShareError
    from . import nnx as nnx
    from ._job import Job as Job
    from ._job import JobSpec as JobSpec
    from ._job import job as job
    from .memory.footprint import Footprint as Footprint
    from .runtime.engine.records import Progress as Progress
    from .runtime.engine.records import StepRecord as StepRecord
    from .runtime.runtime import JobHandle as JobHandle
    from .runtime.runtime import Runtime as Runtime
    from .runtime.run import run as run
    from .runtime.deployed.hub import ModelHandle as ModelHandle
    from .serving.spec import InferError as InferError
    from .serving.spec import ModelSpec as ModelSpec
    from .serving.spec import model as model
    from .sched import POLICIES as POLICIES
    from .runtime.observe.writers import TensorBoardWriter as TensorBoardWriter
    from .runtime.observe.writers import Writer as Writer
