"""The CPU's matrix-multiply kernels, generated before a job's first step needs them.

On a CPU, XLA runs f32 matrix products through oneDNN's GEMM, whose kernels are generated
(Xbyak, at run time) the first time the process multiplies in each layout: ``A @ B``, ``A.T @
B``, ``A @ B.T``, ``A.T @ B.T``, once per process. A training step uses all four (its forward
product and its gradients), so its first execution paid ~20 ms for them on this project's
2-core CPU (``perf``: ``avx512_common_gemm_f32::get_xbyak_gemm`` under ``std::call_once``),
against ~0.4 ms a step after: the hook's Flax net 23 ms -> 3.7 ms, the zoo MLP 24 -> 4, the
digits MLP 25 -> 5, the CNN 40 -> 21, the transformer 98 -> 65, warmed by a program of the four
products on 6x6 matrices (benchmarks/RESULTS.md). The plain loop pays it in its first step.

The runtime pays it on the tiers' thread as it starts (``Workers``), beside the first job's
trace, which holds the GIL while the generation runs in XLA without it; the job's first
execution then finds the kernels made. The program is kept with the runtime's executables
(``executables.py``): a later process loads it instead of lowering it (~2 ms). Once per
process, CPU only (an accelerator's first-call costs are of another kind, not measured here).
Results are the same either way: the same kernels, made earlier. Never fails a run: an error
is logged at debug level and the first step generates its kernels as it would have.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import jax
import numpy as np

from .executables import EXECUTABLES

log = logging.getLogger("xshare.runtime")

_SIDE = 6  # 6x6 f32 matrices: the kernels do not depend on the sizes, and these cost nothing
_started = False
_lock = threading.Lock()


def warm_kernels(device: Any) -> bool:
    """Generate ``device``'s matrix-multiply kernels now, if it is a CPU and this process has
    not (True if this call did). Call it off the caller's path (``Workers`` does: the tiers'
    thread)."""
    global _started
    if device.platform != "cpu":
        return False
    with _lock:
        if _started:
            return False
        _started = True
    try:
        a = np.zeros((_SIDE, _SIDE), np.float32)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device))] * 2

        def run(compiled: Any) -> None:
            # Not waited for: the kernels are made on XLA's thread, without the GIL, while
            # this one lets the first job's trace have it (each wait here is a hand-off of the
            # GIL, ~5 ms with a tracing thread beside: sys.getswitchinterval()). A numpy
            # argument is copied by the call itself (no device_put, another hand-off).
            compiled(a, a)

        compiled, _, loaded = EXECUTABLES.compile(
            EXECUTABLES.key("xshare-warm-gemm", 1, device=device),
            lambda: jax.jit(_products).lower(*args), device=device, nbytes=2 * a.nbytes, trial=run)
        if not loaded:  # (a load ran it as its trial call)
            run(compiled)
    except Exception as err:  # noqa: BLE001 - an optimization: the first step makes them instead
        log.debug("xshare: could not warm the CPU's matrix-multiply kernels: %s", err)
    return True


def _products(a: Any, b: Any) -> list:
    """A @ B in the four layouts a training step uses (forward, and both gradients)."""
    return [(a.T if ta else a) @ (b.T if tb else b) for ta, tb in itertools.product((False, True), repeat=2)]
