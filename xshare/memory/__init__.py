"""Memory bookkeeping: footprints, the reservation ledger of lanes (admission, queueing, swap)."""

from .arena import Admitted as Admitted
from .arena import Arena as Arena
from .arena import LaneInfo as LaneInfo
from .arena import Queued as Queued

from .footprint import Footprint as Footprint

__all__ = ["Admitted", "Arena", "Footprint", "LaneInfo", "Queued"]
