"""xshare: many JAX jobs on one accelerator, with fast job switching and lane-partitioned memory.

The public API; everything else lives in private modules and may change.
"""

from .memory.device import configure_preallocation as _configure_preallocation

# Must run before jax's backend starts: XLA reads the preallocation settings then.
_configure_preallocation()

from ._errors import AdmissionError as AdmissionError  # noqa: E402
from ._errors import FootprintUnknown as FootprintUnknown  # noqa: E402
from ._errors import JobCancelled as JobCancelled  # noqa: E402
from ._errors import JobFailed as JobFailed  # noqa: E402
from ._errors import SpecError as SpecError  # noqa: E402
from ._errors import XShareError as XShareError  # noqa: E402
from ._job import Job as Job  # noqa: E402
from ._job import JobSpec as JobSpec  # noqa: E402
from ._job import job as job  # noqa: E402
from .memory.footprint import Footprint as Footprint  # noqa: E402
from .runtime.records import Progress as Progress  # noqa: E402
from .runtime.records import StepRecord as StepRecord  # noqa: E402
from .runtime.runtime import JobHandle as JobHandle  # noqa: E402
from .runtime.runtime import Runtime as Runtime  # noqa: E402
from .runtime.runtime import run as run  # noqa: E402
from .sched import POLICIES as POLICIES  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # jobs
    "job", "Job", "JobSpec",
    # runtime
    "Runtime", "JobHandle", "Progress", "StepRecord", "run", "POLICIES",
    # memory
    "Footprint",
    # errors
    "XShareError", "AdmissionError", "FootprintUnknown", "JobFailed", "JobCancelled", "SpecError",
]
