"""Host swap: a paused job's state moves to host memory (``pinned_host`` where the device has
it) so its persistent bytes can admit another job, and comes back when the job resumes.

A mixin of :class:`xshare.runtime.Runtime`: these methods share its lock and records.
"""

from __future__ import annotations

import jax

from .records import PAUSED, RUNNING, JobRecord


class OffloadMixin:
    def _offloads(self, lane: int) -> list[JobRecord]:
        """Paused jobs of this lane whose state should move to the host now (lock held)."""
        return [j for j in self._jobs.values()
                if j.lane == lane and j.offload and not j.swapped and j.in_flight == 0
                and j.status == PAUSED and j.hold_for_checkpoint is None and j.state is not None]

    def _host_memory(self):
        kinds = {m.kind for m in self.device.addressable_memories()}
        kind = "pinned_host" if "pinned_host" in kinds else ("unpinned_host" if "unpinned_host" in kinds else None)
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind) if kind else None

    def _swap_out(self, jobs: list[JobRecord]) -> None:
        """Move paused jobs' states to host memory and give their bytes to queued jobs."""
        target = self._host_memory()
        for job in jobs:
            # A device-to-host copy (outside the lock); with no host memory space, numpy.
            host = jax.device_put(job.state, target) if target is not None else jax.device_get(job.state)
            jax.block_until_ready(host)
            with self._cv:
                if not job.offload or job.swapped:  # resumed meanwhile: keep it on the device
                    continue
                job.state, job.swapped = host, True
                self.arena.swap_out(job.id)
                self._log(job, "state offloaded to host memory")
                started = self.arena.retry(in_flight=self._in_flight_jobs())
                self._cv.notify_all()
            self._start_all(started)

    def _waiting_swap_in(self) -> bool:
        with self._cv:
            return any(j.swapped and not j.paused for j in self._jobs.values())

    def _swap_in_waiting(self) -> None:
        """Bring resumed, offloaded jobs back to the device where their lanes have room."""
        with self._cv:
            back = [j for j in self._jobs.values()
                    if j.swapped and not j.paused and j.status == PAUSED
                    and self.arena.swap_in(j.id, in_flight=self._in_flight_jobs())]
            for job in back:
                job.swapped = False  # reserved in the arena; the copy follows
        device_memory = jax.sharding.SingleDeviceSharding(
            self.device, memory_kind=self.device.default_memory().kind)
        for job in back:
            state = jax.device_put(job.state, device_memory, may_alias=False)
            with self._cv:
                job.state = state
                job.status = RUNNING if not job.paused else PAUSED
                self._log(job, "state back on the device")
                self._cv.notify_all()
