"""A job fed by a Grain dataset, run as its own process by test_grain_resume.py (which kills it).

    python -m tests.runtime.grain_job RUN_DIR COUNT_FILE [--resume]

Every record the dataset reads appends its index to COUNT_FILE (a counting map transform), so
the test sees which records each process read.
"""

from __future__ import annotations

import sys
import time

import grain
import numpy as np

import xshare
from tests.helpers import linreg_state, linreg_step

STEPS, BATCH, DIM = 300, 8, 8
N = STEPS * BATCH
X = np.random.default_rng(11).normal(size=(N, DIM)).astype(np.float32)
Y = (X @ np.random.default_rng(12).normal(size=(DIM, 1))).astype(np.float32)


def order() -> list[int]:
    """The record indices in the order the dataset reads them."""
    return [int(i) for i in grain.MapDataset.range(N).shuffle(seed=0)]


def dataset(count_file: str | None = None, delay_s: float = 0.0):
    def read(i):
        if count_file is not None:
            with open(count_file, "a") as f:
                f.write(f"{i}\n")
            time.sleep(delay_s)
        return {"x": X[i], "y": Y[i]}

    ds = grain.MapDataset.range(N).shuffle(seed=0).map(read).batch(BATCH)
    # No read-ahead threads: the records counted are the records the job asked for.
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def spec(count_file: str | None = None, delay_s: float = 0.0):
    return linreg_step.bind(linreg_state(dim=DIM, seed=5), dataset(count_file, delay_s), steps=STEPS,
                            name="grain")


if __name__ == "__main__":
    run_dir, count_file = sys.argv[1], sys.argv[2]
    resume = "--resume" in sys.argv[3:]
    with xshare.Runtime(memory="64MiB", log_dir=run_dir, checkpoint_every=20, resume=resume) as rt:
        h = rt.submit(spec(count_file, delay_s=0.0 if resume else 0.001))
    sys.exit(0 if h.status() == "done" else 1)
