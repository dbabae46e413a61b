"""The previous checkpoint format (xshare before Orbax): one ``{dir}/{job}/checkpoint.msgpack``
per job in flax.serialization's msgpack format, read so that a run checkpointed by an older
xshare still resumes (``checkpoint.load`` falls back to it); new checkpoints are Orbax's.

The file was replaced atomically (write, fsync, rename). The state is stored as its flat list
of leaves; restoring needs the job's freshly built initial state for the tree structure, which
is checked leaf by leaf. ``save`` stays for the checkpoint-cost benchmark's "before" column and
for tests that write an old-format checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..._errors import XShareError
from ..compiled.leaves import Layout, layout_of, promoted

FILENAME = "checkpoint.msgpack"


@dataclass(frozen=True)
class Checkpoint:
    step: int                       # steps completed: the next step to run
    state: Any                      # host pytree, same structure as the job's initial state
    metrics: dict[str, float] | None
    done: bool                      # the job had finished all its steps
    data_state: Any = None          # the data iterator's get_state() at ``step`` (None: replay)


def kinds_of(layout: Layout) -> str:
    """Per leaf of the tree: carried ("a") or static ("s"), stored with a checkpoint so that a
    Python number of the initial state that the step turned into an array restores as that array."""
    return "".join("s" if k is not None and k[0] == "static" else "a" for k in layout.kinds)


def layout_as_saved(like: Any, kinds: str | None) -> tuple[list, Layout]:
    """``layout_of(like)``, with the leaves that ``kinds`` (:func:`kinds_of` at save time) says
    were carried promoted to arrays; ``kinds`` None or of another tree: ``like`` as it is."""
    if kinds is not None and len(kinds) == len(jax.tree.leaves(like)):
        like = promoted(like, frozenset(i for i, k in enumerate(kinds) if k == "a"))
    return layout_of(like)


def path_for(directory: Path, job_dir: str) -> Path:
    return Path(directory) / job_dir / FILENAME


def save(path: Path, *, step: int, state: Any, metrics: dict[str, float] | None, done: bool) -> None:
    arrays, layout = layout_of(state)
    payload = {
        "version": 2, "step": int(step), "done": bool(done),
        "leaves": {str(i): np.asarray(leaf) for i, leaf in enumerate(arrays)},
        # PRNG key leaves are stored as their key data; their impls make resume exact.
        "keys": {str(i): impl for i, impl in enumerate(layout.keys_of()) if impl is not None},
        "kinds": kinds_of(layout),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    from flax import serialization  # (flax costs ~0.2 s to import: only when a checkpoint is written)

    data = serialization.msgpack_serialize(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, like: Any, *, job: str) -> Checkpoint | None:
    """The checkpoint at ``path`` shaped like ``like`` (the job's initial state, whose static
    leaves it keeps); None if absent."""
    if not path.exists():
        return None
    try:
        from flax import serialization

        payload = serialization.msgpack_restore(path.read_bytes())
    except Exception as err:
        raise XShareError(f"job {job!r}: checkpoint {path} is unreadable ({err}); delete it to "
                          "restart the job from scratch") from err
    ref_arrays, layout = layout_as_saved(like, payload.get("kinds"))
    stored = payload.get("leaves", {})
    if len(stored) != len(ref_arrays):
        raise XShareError(f"job {job!r}: checkpoint {path} holds {len(stored)} arrays but the job's "
                          f"state has {len(ref_arrays)}; the model changed since it was written")
    stored_keys = payload.get("keys", {})
    arrays = []
    for i, (ref, name, impl) in enumerate(zip(ref_arrays, layout.array_paths(), layout.keys_of())):
        leaf = np.asarray(stored[str(i)])
        if leaf.shape != np.shape(ref) or leaf.dtype != np.asarray(ref).dtype:
            raise XShareError(f"job {job!r}: checkpoint {path} array {i} ({name}) is "
                              f"{leaf.dtype}{list(leaf.shape)} but the job's state has "
                              f"{np.asarray(ref).dtype}{list(np.shape(ref))}")
        if stored_keys.get(str(i)) != impl:
            raise XShareError(f"job {job!r}: checkpoint {path} leaf {name} holds "
                              f"{_key_kind(stored_keys.get(str(i)))} but the job's state has "
                              f"{_key_kind(impl)}; the model changed since it was written")
        arrays.append(leaf)
    return Checkpoint(step=int(payload["step"]), state=layout.merge(arrays),
                      metrics=dict(payload.get("metrics") or {}) or None, done=bool(payload.get("done")))


def _key_kind(impl: str | None) -> str:
    return "a plain array" if impl is None else f"PRNG key data ({impl})"
