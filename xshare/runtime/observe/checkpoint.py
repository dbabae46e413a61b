"""Per-job checkpoints in Orbax's format: ``{dir}/{job}/checkpoint/{step}/``.

Each job's checkpoints are one ``orbax.checkpoint.CheckpointManager`` directory, a step
subdirectory per checkpoint, the newest ``keep`` kept. A step holds two Orbax items:

* ``state``: the job's state as the user bound it (``StandardSave``): arrays as numpy arrays,
  typed PRNG keys as key arrays (Orbax stores their impl), static leaves (functions, strings,
  objects that are not arrays) as ``None``. So a user restores it with plain Orbax
  (``mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))``).
* ``meta``: JSON (``JsonSave``): the format, the step, whether the job was done, its last
  metrics, each carried array's dtype and shape, key impls, which leaves were static, and the
  state of the job's data iterator (``get_state()``) at that step.

Orbax writes a step into a temporary directory and renames it when complete, so a process
killed at any instant leaves the previous steps and never a torn one. Saving runs on the
recorder thread from host copies, synchronously there (see ``_manager``). A checkpoint of the previous format
(``checkpoint.msgpack``, ``checkpoint_msgpack``) is still read when no Orbax step exists.

Orbax is imported on the first save or load (about 0.1 s after jax and flax), never by a
runtime that does not checkpoint, nor by ``import xshare``.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..._errors import XShareError
from . import checkpoint_msgpack
from .checkpoint_msgpack import Checkpoint, kinds_of, layout_as_saved
from ..compiled.leaves import is_array, is_key, layout_of

__all__ = ["Checkpoint", "FILENAME", "KEEP", "save", "load", "path_for", "steps", "Managers"]

log = logging.getLogger("xshare.runtime")

FILENAME = "checkpoint"   # the Orbax directory of a job: {dir}/{job}/checkpoint/{step}/
KEEP = 3                  # steps kept per job (Orbax's max_to_keep)
FORMAT = "xshare.checkpoint/3"


def path_for(directory: Path, job_dir: str) -> Path:
    return Path(directory) / job_dir / FILENAME


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # a dependency of flax; slow to import, so only here
    absl = logging.getLogger("absl")
    if absl.level == logging.NOTSET:
        # Orbax logs a dozen INFO lines per save through absl: a long-running `xshare serve`
        # would log little else. Its warnings and errors still show.
        absl.setLevel(logging.WARNING)
    return ocp


def warm() -> None:
    """Import Orbax now (a runtime that will checkpoint, on its recorder thread)."""
    _ocp()


def steps(path: Path) -> list[int]:
    """The committed steps under ``path``, read from the directory names (Orbax names a step
    ``{step}`` once it is complete; one in progress has a temporary name), without Orbax."""
    try:
        return sorted(int(p.name) for p in Path(path).iterdir() if p.name.isdigit() and p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _manager(path: Path, keep: int) -> Any:
    ocp = _ocp()
    # Synchronous saves: the recorder thread already keeps them off the dispatcher, an
    # asynchronous save measured no faster per save here, and its background commit threads
    # stalled for tens of seconds under `xshare serve` with several jobs saving at once.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(path).absolute(), options=options)


class Managers:
    """The open ``CheckpointManager`` of each job a recorder checkpoints (one per job directory,
    kept while the job lives: creating one reads its directory). Used on the recorder thread."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._open: dict[Path, Any] = {}
        self._last: dict[Path, int] = {}
        self._lock = threading.Lock()

    def get(self, path: Path) -> Any:
        with self._lock:
            mngr = self._open.get(path)
            if mngr is None:
                mngr = self._open[path] = _manager(path, self.keep)
            return mngr

    def wait(self) -> None:
        """Until every save started so far is on disk."""
        for mngr in list(self._open.values()):
            mngr.wait_until_finished()

    def close(self, path: Path | None = None) -> None:
        """Finish and close ``path``'s manager (every one if None)."""
        with self._lock:
            paths = list(self._open) if path is None else [path]
            closing = [self._open.pop(p) for p in paths if p in self._open]
            for p in paths:
                self._last.pop(p, None)
        for mngr in closing:
            mngr.close()


def save(path: Path, *, step: int, state: Any, metrics: dict[str, float] | None, done: bool,
         data_state: Any = None, managers: Managers | None = None) -> None:
    """Checkpoint ``state`` (on the host) after ``step`` steps into the Orbax directory ``path``
    (``managers``: the recorder's open managers; None: open one for this save and close it)."""
    ocp = _ocp()
    arrays, layout = layout_of(state)
    meta = {
        "format": FORMAT, "step": int(step), "done": bool(done),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
        "arrays": [[str(np.asarray(a).dtype), list(np.shape(a))] for a in arrays],
        "paths": layout.array_paths(),
        "keys": [impl for impl in layout.keys_of()],
        "kinds": kinds_of(layout),  # so that a number the step made an array restores as one
        "data_state": _data_state_or_none(data_state, path),
    }
    own = managers is None
    managers = managers or Managers()
    mngr = managers.get(path)
    try:
        last = managers._last.get(path)
        if last is not None and step <= last:
            mngr.wait_until_finished()  # the same step again (stop() right after a periodic save)
        for old in steps(path):
            # Steps at or after this one are a previous run's future (a job rerun without
            # resume) or this very step saved before it was done: this save replaces them.
            if old >= step:
                mngr.reload()
                mngr.delete(old)
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_orbax_tree(state)),
                                                meta=ocp.args.JsonSave(meta)), force=True)
        managers._last[path] = step
    finally:
        if own:
            managers.close(path)


def _orbax_tree(tree: Any) -> Any:
    """``tree`` as Orbax saves it: numpy arrays, typed keys as they are, static leaves None.
    Zero-size arrays are None too (Orbax refuses them; they hold nothing, and the meta item
    keeps their dtype and shape)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [None if not is_array(x) or np.size(x) == 0
                              else x if is_key(x) else np.asarray(x) for x in leaves])


def load(path: Path, like: Any, *, job: str) -> Checkpoint | None:
    """The newest checkpoint at ``path`` (a job's Orbax directory, or an old
    ``checkpoint.msgpack``) shaped like ``like`` (the job's initial state, whose static leaves
    it keeps); None if there is none."""
    path = Path(path)
    if path.suffix == ".msgpack":
        return checkpoint_msgpack.load(path, like, job=job)
    found = steps(path)
    if not found:
        old = path.parent / checkpoint_msgpack.FILENAME
        if old.exists():  # written by xshare before its checkpoints were Orbax's
            log.info("job %r: resuming from the previous format's %s", job, old)
            return checkpoint_msgpack.load(old, like, job=job)
        return None
    ocp = _ocp()
    step = found[-1]
    # The step's items read directly, not through a CheckpointManager: a manager lists the
    # directory first, and a step its writer deletes meanwhile (keep) would fail the read.
    where = f"checkpoint {path / str(step)}"
    try:
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
            meta = reader.restore(path / str(step) / "meta")
    except Exception as err:
        raise XShareError(f"job {job!r}: {where} is unreadable ({err}); delete {path / str(step)} "
                          "to resume from the step before it") from err
    ref_arrays, layout = layout_as_saved(like, meta.get("kinds"))
    _check(meta, ref_arrays, layout, job=job, where=where)
    target = _orbax_tree(layout.merge([np.asarray(a) for a in ref_arrays]))
    try:
        with ocp.StandardCheckpointer() as reader:
            restored = reader.restore(path / str(step) / "state", target)
    except Exception as err:
        raise XShareError(f"job {job!r}: {where} could not be restored ({err})") from err
    carried = [x for x, kind in zip(layout.treedef.flatten_up_to(restored), layout.kinds)
               if kind is None or kind[0] != "static"]
    arrays = [np.asarray(ref) if np.size(ref) == 0  # (not stored: see _orbax_tree)
              else np.asarray(jax.random.key_data(x)) if impl is not None else np.asarray(x)
              for x, ref, impl in zip(carried, ref_arrays, layout.keys_of())]
    return Checkpoint(step=int(meta["step"]), state=layout.merge(arrays),
                      metrics=dict(meta.get("metrics") or {}) or None, done=bool(meta.get("done")),
                      data_state=decode_data_state(meta.get("data_state")))


def _check(meta: dict, ref_arrays: list, layout: Any, *, job: str, where: str) -> None:
    """The stored arrays against the job's state, with what differs and why it matters."""
    stored = meta.get("arrays") or []
    if len(stored) != len(ref_arrays):
        raise XShareError(f"job {job!r}: {where} holds {len(stored)} arrays but the job's state has "
                          f"{len(ref_arrays)}; the model changed since it was written")
    stored_keys = meta.get("keys") or [None] * len(stored)
    for i, (ref, name, impl) in enumerate(zip(ref_arrays, layout.array_paths(), layout.keys_of())):
        dtype, shape = stored[i]
        ref_dtype, ref_shape = str(np.asarray(ref).dtype), list(np.shape(ref))
        if dtype != ref_dtype or list(shape) != ref_shape:
            raise XShareError(f"job {job!r}: {where} array {i} ({name}) is {dtype}{list(shape)} but "
                              f"the job's state has {ref_dtype}{ref_shape}")
        if stored_keys[i] != impl:
            raise XShareError(f"job {job!r}: {where} leaf {name} holds {_key_kind(stored_keys[i])} "
                              f"but the job's state has {_key_kind(impl)}; the model changed since "
                              "it was written")


def _key_kind(impl: str | None) -> str:
    return "a plain array" if impl is None else f"PRNG key data ({impl})"


# ---------------------------------------------------------------- data iterator states
def encode_data_state(value: Any) -> Any:
    """A data iterator's ``get_state()`` as JSON: JSON values as themselves, bytes as base64
    (Grain's ``DataLoader`` iterators return bytes, its dataset iterators a dict)."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return {"bytes_b64": base64.b64encode(bytes(value)).decode("ascii")}
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise XShareError(f"the data iterator's get_state() returned {type(value).__name__}, which is "
                          f"neither JSON nor bytes ({err}); return a dict of plain values or bytes") from err
    return {"json": value}


def _data_state_or_none(value: Any, path: Path) -> Any:
    try:
        return encode_data_state(value)
    except XShareError as err:  # the checkpoint still holds the state; resume replays the data
        log.warning("%s: %s", path, err)
        return None


def decode_data_state(stored: Any) -> Any:
    if not stored:
        return None
    if "bytes_b64" in stored:
        return base64.b64decode(stored["bytes_b64"])
    return stored["json"]
