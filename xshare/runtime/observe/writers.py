"""Metric writers: each job's train and eval rows (the rows of its ``metrics.jsonl``) sent to a
tracker as well, TensorBoard's event files first.

A writer is one job's connection to a tracker, behind a small protocol (``Writer``). The
runtime makes one per job from each of its ``writers`` (a name, or a factory called with the
job's directory), and calls it on the recorder thread only: ``open`` once, ``scalars`` for each
row in step order, ``flush`` after each batch of rows (so a reader sees a running job's rows
within a batch, as it does in ``metrics.jsonl``), ``close`` when the job ends. A writer that
raises is turned off for that job with one warning; training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from ..._errors import XShareError

log = logging.getLogger("xshare.runtime")


@runtime_checkable
class Writer(Protocol):
    """One job's metrics to one tracker. Called on the runtime's recorder thread only."""

    def open(self, job: str, params: Mapping[str, Any], *, first_step: int = 0) -> None:
        """The job ``job`` starts (or resumes at ``first_step``: rows from that step on are
        written again, so a tracker that can should drop the ones it holds). ``params``: the
        job's hyperparameters (a launch grid's or a study trial's; ``bind(meta={"params":
        ...})``), possibly empty."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One row: the metrics of ``step`` (train names as the step returns them, evaluation
        as ``eval/<name>``)."""

    def flush(self) -> None:
        """Make the rows written so far visible to readers."""

    def close(self) -> None:
        """The job ended; release files and connections."""


Factory = Callable[[Path], Writer]


class TensorBoardWriter:
    """A job's TensorBoard run: event files in the job's directory (so ``tensorboard --logdir
    RUN_DIR`` shows one run per job), one scalar series per metric, and the job's parameters
    as HParams (the HParams dashboard compares a sweep's or a study's jobs).

    Written with tensorboardX (``pip install 'xshare[tensorboard]'``): it writes TensorBoard's
    event format and HParams summaries without TensorFlow (TensorBoard's own writer needs TF
    for its summary ops, and torch.utils.tensorboard needs torch).
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._writer: Any = None

    def open(self, job: str, params: Mapping[str, Any], *, first_step: int = 0) -> None:
        """Start the job's event file in ``directory``, with ``params`` as its HParams; events at
        or after ``first_step`` in earlier files of the run are dropped (a resumed job).

        Raises:
          XShareError: tensorboardX is not installed (``pip install 'xshare[tensorboard]'``).
        """
        try:
            from tensorboardX import SummaryWriter
            from tensorboardX.summary import hparams
        except ImportError as err:
            raise XShareError("TensorBoard event files need tensorboardX: pip install 'xshare[tensorboard]'") from err
        # purge_step: TensorBoard drops the events at or after it from the earlier files, as
        # the resume drops those rows of metrics.jsonl (they run again).
        # The file name's own timestamp is in seconds: a job resumed within the second would
        # overwrite its first file. Nanoseconds keep the files apart and in order (TensorBoard
        # reads a run's files sorted by name).
        self._writer = SummaryWriter(logdir=str(self.directory), purge_step=first_step or None,
                                     flush_secs=5, filename_suffix=f".{time.time_ns()}")
        if params:
            # Only the session start (each run's own hparams): TensorBoard builds the
            # experiment (every job's hparams and the metrics) from the runs' sessions.
            _, start, _ = hparams({k: _hparam(v) for k, v in params.items()}, {})
            self._writer.file_writer.add_summary(start)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One step's metrics, each a scalar tagged as in ``metrics.jsonl``."""
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        """Write what was added to the event file (the recorder calls it with each batch of rows)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (the job ended)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _hparam(value: Any) -> Any:
    """An HParams value: a number, a bool or a string (a list or a path as its text)."""
    if isinstance(value, (bool, str)) or isinstance(value, numbers.Real):
        return value
    return str(value)


def _mlflow(directory: Path) -> Writer:
    from .mlflow_writer import MLflowWriter  # (mlflow is imported when the job opens it)
    return MLflowWriter(directory)


WRITERS: dict[str, Factory] = {"tensorboard": TensorBoardWriter, "mlflow": _mlflow}
_MODULES = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow")}


def resolve(writers: Sequence[str | Factory] | None) -> list[Factory]:
    """``Runtime(writers=...)``: names of built-in writers or factories ``directory -> Writer``."""
    out: list[Factory] = []
    for w in writers or ():
        if isinstance(w, str):
            if w not in WRITERS:
                raise ValueError(f"writers: unknown writer {w!r}; use one of {sorted(WRITERS)} or a "
                                 "callable (job directory -> Writer)")
            module, extra = _MODULES[w]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"writers: {w!r} needs {module}: pip install 'xshare[{extra}]'")
            out.append(WRITERS[w])
        elif callable(w):
            out.append(w)
        else:
            raise ValueError(f"writers: {w!r} is neither a writer name ({sorted(WRITERS)}) nor a "
                             "callable (job directory -> Writer)")
    return out


_said_off = False


def defaults() -> list[str]:
    """The writers ``xshare launch`` and ``xshare tune`` use: TensorBoard's when its extra is
    installed (logged once, at INFO, when it is not)."""
    global _said_off
    if importlib.util.find_spec("tensorboardX") is not None:
        return ["tensorboard"]
    if not _said_off:
        _said_off = True
        log.info("TensorBoard event files are off: pip install 'xshare[tensorboard]' to write them")
    return []


def row_values(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row's metric values (its numbers, without ``step`` and ``time_s``)."""
    return {k: float(v) for k, v in row.items() if k not in ("step", "time_s")
            and isinstance(v, numbers.Real) and not isinstance(v, bool)}
