"""The device effects of admission: a job's state onto the device, to host memory, and back.

``admission.Admission`` decides (on the ledger, without jax); this places. Runs on the
dispatcher thread.
"""

from __future__ import annotations

from typing import Any

import jax

from ... import ffi
from ..compiled import fusion


class Placer:
    """Puts jobs' state leaves on ``device`` (and their fence ident, with a fence ring)."""

    def __init__(self, device: Any, ring: int | None):
        self.device, self.ring = device, ring

    def put(self, job: Any, lane: int) -> None:
        if job.host_arrays is not None:  # back from host memory
            kind = self.device.default_memory().kind
            target = jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)
            job.arrays = jax.device_put(job.host_arrays, target, may_alias=False)
        else:
            # The runtime keeps the state as flat leaves (see compiler._flat_step) and owns
            # its copy: the user's arrays stay valid (bind does not take ownership).
            job.arrays = jax.device_put(job.initial_arrays(), self.device, may_alias=False)
        if self.ring is not None and (job.ident is None or job.lane != lane):
            job.ident = jax.device_put(ffi.ident(self.ring, job.id, lane), self.device)

    def to_host(self, job: Any) -> None:
        kinds = {m.kind for m in self.device.addressable_memories()}
        kind = next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)
        if kind is not None:  # host memory of the device (pinned where it has it)
            host = jax.device_put(job.arrays, jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind))
            jax.block_until_ready(host)
        else:
            host = jax.device_get(job.arrays)
        job.host_arrays, job.arrays = host, None


def state_of(job: Any) -> Any:
    """A job's state leaves wherever they are: its own arrays, its group slot, the host."""
    if job.group is not None:
        return fusion.take(job.group.fused, job.group.arrays, job.slot)
    return job.arrays if job.arrays is not None else job.host_arrays


def read_state(job: Any) -> Any:
    """A job's state as the user's pytree on the host (one device-to-host copy)."""
    arrays = state_of(job)
    return None if arrays is None else job.user_state(jax.device_get(arrays))
