"""Per-job checkpoints: the state after a step, in flax.serialization's msgpack format.

One file per job, ``{dir}/{job}/checkpoint.msgpack``, replaced atomically (write, fsync,
rename), so a process killed at any instant leaves either the previous checkpoint or the new
one, never a torn file. The state is stored as its flat list of leaves; restoring needs the
job's freshly built initial state for the tree structure, which is checked leaf by leaf.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import serialization

from .._errors import XShareError

FILENAME = "checkpoint.msgpack"


@dataclass(frozen=True)
class Checkpoint:
    step: int                       # steps completed: the next step to run
    state: Any                      # host pytree, same structure as the job's initial state
    metrics: dict[str, float] | None
    done: bool                      # the job had finished all its steps


def path_for(directory: Path, job_dir: str) -> Path:
    return Path(directory) / job_dir / FILENAME


def save(path: Path, *, step: int, state: Any, metrics: dict[str, float] | None, done: bool) -> None:
    leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    payload = {
        "version": 1, "step": int(step), "done": bool(done),
        "leaves": {str(i): leaf for i, leaf in enumerate(leaves)},
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    data = serialization.msgpack_serialize(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, like: Any, *, job: str) -> Checkpoint | None:
    """The checkpoint at ``path`` shaped like ``like`` (the job's initial state); None if absent."""
    if not path.exists():
        return None
    try:
        payload = serialization.msgpack_restore(path.read_bytes())
    except Exception as err:
        raise XShareError(f"job {job!r}: checkpoint {path} is unreadable ({err}); delete it to "
                          "restart the job from scratch") from err
    ref_leaves, treedef = jax.tree.flatten(like)
    stored = payload.get("leaves", {})
    if len(stored) != len(ref_leaves):
        raise XShareError(f"job {job!r}: checkpoint {path} holds {len(stored)} arrays but the job's "
                          f"state has {len(ref_leaves)}; the model changed since it was written")
    leaves = []
    for i, ref in enumerate(ref_leaves):
        leaf = np.asarray(stored[str(i)])
        if leaf.shape != np.shape(ref) or leaf.dtype != np.asarray(ref).dtype:
            raise XShareError(f"job {job!r}: checkpoint {path} array {i} is {leaf.dtype}{list(leaf.shape)} "
                              f"but the job's state has {np.asarray(ref).dtype}{list(np.shape(ref))}")
        leaves.append(leaf)
    return Checkpoint(step=int(payload["step"]), state=jax.tree.unflatten(treedef, leaves),
                      metrics=dict(payload.get("metrics") or {}) or None, done=bool(payload.get("done")))
