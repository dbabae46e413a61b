"""The recorder thread: every file write of the runtime, off the dispatcher's path.

Metrics lines, log lines and checkpoint files go through one queue to one thread, so the
dispatcher never blocks on a disk. A write that fails (directory deleted, disk full, lost
permission) turns that job's logging off with one warning and fails nothing: training goes on,
and the previous checkpoint stays valid (checkpoints are written atomically).

Each job's files live in ``{log_dir}/{job_dir(name)}/``: ``metrics.jsonl``, ``log.txt`` and
(under ``checkpoint_dir``) ``checkpoint/``, the job's Orbax checkpoints (``checkpoint.py``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from . import checkpoint, released
from ..causes import short_error
from .writers import row_values

log = logging.getLogger("xshare.runtime")

_SAFE = "-_.=,+@"

# At most this share of the recorder's time goes to periodic checkpoints (after a save of t
# seconds, the next periodic one waits t * (1 / CHECKPOINT_DUTY - 1)); a job's final
# checkpoint and those of stop() are always written. benchmarks/RESULTS.md "Checkpoint cost".
CHECKPOINT_DUTY = 0.25

# At most one heap trim a second after final states were released (keep_results=False): one
# per job would be as good for a service, but not for a sweep of many short jobs.
TRIM_EVERY_S = 1.0


def job_dir(name: str) -> str:
    """The directory name of a job: its name with every other character percent-encoded, so
    two names never share a directory ("a/b" -> "a%2Fb", "a_b" stays) and no name leaves
    ``log_dir``. Names that would still be special ("", ".", "..") are refused at submit."""
    return urllib.parse.quote(name, safe=_SAFE)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name:
        raise ValueError(f"job name {name!r} cannot name a directory; use letters, digits and -_.=,")
    return name


def check_new_names(names: list[Any], taken: set[str]) -> None:
    """Refuse names that cannot name a directory, that a job of this runtime has (``taken``),
    or whose directory another job's would share (with the fix in the message)."""
    seen = set(taken)
    dirs = {job_dir(n) for n in seen}
    for name in names:
        check_name(name)
        if name in seen:
            raise ValueError(f"a job named {name!r} was already submitted to this runtime; "
                             "give each job a unique name")
        if job_dir(name) in dirs:
            raise ValueError(f"job name {name!r} maps to the same directory as another "
                             "job's; rename one of them")
        seen.add(name)
        dirs.add(job_dir(name))


class Recorder:
    def __init__(self, *, log_dir: Path | None, checkpoint_dir: Path | None, t0: float,
                 tick: Callable[[], None] | None = None, tick_s: float = 0.2,
                 checkpoint_keep: int = checkpoint.KEEP, writers: list | None = None):
        self.log_dir, self.checkpoint_dir, self.t0 = log_dir, checkpoint_dir, t0
        # Factories (job directory -> writers.Writer), and each open job's writers.
        self._factories = list(writers or ())
        self._writers: dict[int, list] = {}
        self._managers = checkpoint.Managers(checkpoint_keep)
        # The newest step each job posted a checkpoint for. An Orbax save costs tens of ms of
        # this thread: a job that checkpoints faster than that has its older queued checkpoints
        # skipped (the newest is always written), so the queue never piles up host copies.
        self._newest_checkpoint: dict[int, int] = {}
        self._pending: dict[int, int] = {}  # job id -> its checkpoints posted, not yet written
        self._pending_lock = threading.Lock()
        self._save_gate = 0.0  # (monotonic s) periodic checkpoints wait until then
        self._trim_due, self._trimmed = False, 0.0  # a released state to hand back (released.trim)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._files: dict[int, Any] = {}
        self._broken: set[int] = set()
        # Jobs whose close_job came before their open (cancelled while compiling). Read and
        # written on the recorder thread only; an id leaves when its late open arrives.
        self._closed_early: set[int] = set()
        self._tick, self._tick_s = tick, tick_s
        self._thread = threading.Thread(target=self._run, name="xshare-recorder", daemon=True)
        self._thread.start()
        if checkpoint_dir is not None:
            # Orbax's first import (~0.5 s) here, beside the first compiles, not at a job's first
            # checkpoint, where it would delay that checkpoint by as much.
            self._queue.put((checkpoint.warm, ()))

    # ------------------------------------------------------------------ posting (any thread)
    def open(self, job: Any, *, resume_from: int | None = None) -> None:
        if self.log_dir is not None:
            self._queue.put((self._open, (job, resume_from)))

    def line(self, job: Any, text: str) -> None:
        if self.log_dir is not None:
            self._queue.put((self._line, (job, text)))

    def metrics_rows(self, rows: list) -> None:
        """Steps' metrics rows ``(job, step, t_s, values, extra)``, in order (``values`` is the
        packed vector; the names come from the job's program)."""
        self._queue.put((self._metrics_rows, (rows,)))

    def checkpoint(self, job: Any, step: int, state: Any, metrics: dict | None, *, done: bool,
                   data_state: Any = None, release: bool = False) -> None:
        """Write ``state`` (already on the host) as the job's checkpoint after ``step`` steps,
        with its data iterator's state at that step (None: a resume replays its data).
        ``release``: once written, the job keeps its final state there only
        (``released.release``; a write that failed releases nothing)."""
        self._newest_checkpoint[job.id] = step
        with self._pending_lock:
            self._pending[job.id] = self._pending.get(job.id, 0) + 1
        self._queue.put((self._checkpoint, (job, step, state, metrics, done, data_state, release)))

    def saving(self, job: Any) -> bool:
        """The dispatcher skips a periodic checkpoint of ``job`` now (and the pipeline drain
        and device-to-host copy it would cost): one of its checkpoints is still queued or being
        written, or the recorder has spent more than ``CHECKPOINT_DUTY`` of its time saving.
        An Orbax save costs tens of ms of Python (the GIL the dispatcher needs): checkpoints
        asked for faster than that would slow every job's steps, not only the one saving."""
        return self._pending.get(job.id, 0) > 0 or time.monotonic() < self._save_gate

    def close_job(self, job: Any) -> None:
        if self.log_dir is not None or self.checkpoint_dir is not None:
            self._queue.put((self._close_job, (job,)))

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything posted so far is written. After ``close`` it returns at once:
        the thread wrote everything posted before it stopped (``wait()`` after ``stop()``, as
        a ``with Runtime()`` block that calls ``stop`` does on exit, used to wait the full 30 s)."""
        done = threading.Event()
        self._queue.put((self._managers.wait, ()))  # (a no-op while Orbax saves synchronously)
        self._queue.put((done.set, ()))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.05):
            if not self._thread.is_alive():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._tick_s)
            except queue.Empty:
                item = ()
            if item is None:
                for f in self._files.values():
                    _quiet_close(f)
                self._files.clear()
                for job_writers in self._writers.values():
                    for w in job_writers:
                        _quiet_close(w)
                self._writers.clear()
                try:
                    self._managers.close()  # waits for the checkpoints still being written
                except Exception as err:  # noqa: BLE001
                    log.warning("xshare recorder: finishing checkpoints failed: %s", err)
                return
            if item:
                fn, args = item
                try:
                    fn(*args)
                except Exception as err:  # noqa: BLE001 - the recorder must never die
                    log.warning("xshare recorder: %s failed: %s", getattr(fn, "__name__", fn), err)
                item = fn = args = None  # (a released state's last references go here, before the trim)
            if self._trim_due and time.monotonic() >= self._trimmed + TRIM_EVERY_S:
                # keep_results=False released a final state: its pages back to the OS.
                self._trim_due, self._trimmed = False, time.monotonic()
                released.trim()
            if self._tick is not None and (not item or self._queue.empty()):
                try:
                    self._tick()
                except Exception as err:  # noqa: BLE001
                    log.warning("xshare recorder: timing update failed: %s", err)

    def _dir(self, job: Any) -> Path:
        assert self.log_dir is not None  # (asked only when logging)
        return self.log_dir / job_dir(job.name)

    def _broke(self, job: Any, what: str, err: BaseException) -> None:
        if job.id not in self._broken:
            self._broken.add(job.id)
            log.warning("job %r: %s failed (%s); its logging is off from here, training goes on",
                        job.name, what, short_error(err))
        _quiet_close(self._files.pop(job.id, None))

    def _open(self, job: Any, resume_from: int | None) -> None:
        try:
            d = self._dir(job)
            d.mkdir(parents=True, exist_ok=True)
            path = d / "metrics.jsonl"
            if resume_from is not None and path.exists():
                # Steps after the checkpoint ran but their state was lost: they run again, so
                # their old rows go (the file then reads like an uninterrupted run's). A torn
                # last line (the disk filled, the process was killed mid-write) is dropped.
                keep = []
                for ln in path.read_text().splitlines():
                    try:
                        row = json.loads(ln)
                    except ValueError:
                        log.warning("job %r: dropped a torn line of %s", job.name, path)
                        continue
                    if row.get("step", -1) < resume_from:
                        keep.append(ln)
                path.write_text("".join(ln + "\n" for ln in keep))
            (d / "log.txt").touch()
            if job.id in self._closed_early:
                # Cancelled while compiling: its close_job already ran, and a file opened now
                # would never be closed (one leaked descriptor per such job). Asked of this
                # queue's order, not of job.state: a fast job can be done before the recorder
                # reaches its open, and its rows (queued after the open) still need the file.
                self._closed_early.discard(job.id)
                return
            self._files[job.id] = open(path, "a", buffering=1 << 16)
        except OSError as err:
            self._broke(job, "opening its log directory", err)
            return
        self._open_writers(job, d, resume_from)

    def _open_writers(self, job: Any, d: Path, resume_from: int | None) -> None:
        params = dict((getattr(job.spec, "meta", None) or {}).get("params") or {})
        opened = []
        for factory in self._factories:
            try:
                w = factory(d)
                w.open(job.name, params, first_step=resume_from or 0)
                opened.append(w)
            except Exception as err:  # noqa: BLE001 - a tracker never fails training
                log.warning("job %r: writer %s failed to open (%s); its metrics go to metrics.jsonl only",
                            job.name, getattr(factory, "__name__", factory), short_error(err))
        if opened:
            self._writers[job.id] = opened

    def _call_writers(self, job: Any, method: str, *args: Any) -> None:
        for w in list(self._writers.get(job.id, ())):
            try:
                getattr(w, method)(*args)
            except Exception as err:  # noqa: BLE001 - a tracker never fails training
                log.warning("job %r: writer %s failed (%s); it is off for this job", job.name,
                            type(w).__name__, short_error(err))
                self._writers[job.id].remove(w)
                _quiet_close(w)

    def _line(self, job: Any, text: str) -> None:
        if job.id in self._broken or self.log_dir is None:
            return  # (a checkpoint's failure, with checkpoint_dir but no log_dir: logged only)
        try:
            d = self._dir(job)
            # A line can come before the job's open (it was cancelled while compiling): make
            # its directory, but never log_dir itself (gone means gone: logging is off).
            d.mkdir(exist_ok=True)
            with open(d / "log.txt", "a") as f:
                f.write(text.rstrip("\n") + "\n")
        except OSError as err:
            self._broke(job, "writing log.txt", err)

    def _metrics_rows(self, rows: list) -> None:
        touched = {}
        for job, step, t_s, values, extra in rows:
            f = self._files.get(job.id)
            if f is None:
                continue
            touched[job.id] = (job, f)
            row = {"step": step, "time_s": round(t_s - self.t0, 6),
                   **dict(zip(job.program.metric_names, values.tolist()))}
            if extra:
                row.update(extra)
            try:
                f.write(json.dumps(row) + "\n")
            except (OSError, ValueError) as err:
                self._broke(job, "writing metrics.jsonl", err)
            if job.id in self._writers:
                self._call_writers(job, "scalars", step, row_values(row))
        # Rows reach the file a batch at a time (the dispatcher hands over up to 256 rows, or
        # fewer when it idles), not when a 64 KiB buffer fills: readers of the run directory
        # (`xshare tune --ray` reports and prunes from these files) see a running job's rows
        # within a batch. One flush per file per batch, not per row.
        for job, f in touched.values():
            if job.id in self._writers:
                self._call_writers(job, "flush")
            if job.id in self._broken or f.closed:
                continue
            try:
                f.flush()
            except (OSError, ValueError) as err:
                self._broke(job, "writing metrics.jsonl", err)

    def _checkpoint(self, job: Any, step: int, state: Any, metrics: dict | None, done: bool,
                    data_state: Any, release: bool = False) -> None:
        t0 = time.monotonic()
        try:
            path = self._write_checkpoint(job, step, state, metrics, done, data_state)
            if release and path is not None:
                released.release(job, step, path, state)
                self._trim_due = True
        finally:
            t1 = time.monotonic()
            self._save_gate = t1 + (t1 - t0) * (1 / CHECKPOINT_DUTY - 1)
            with self._pending_lock:
                left = self._pending.get(job.id, 1) - 1
                if left > 0:
                    self._pending[job.id] = left
                else:
                    self._pending.pop(job.id, None)

    def _write_checkpoint(self, job: Any, step: int, state: Any, metrics: dict | None, done: bool,
                          data_state: Any) -> Path | None:
        """The checkpoint's directory once written; None if skipped or failed."""
        if not done and self._newest_checkpoint.get(job.id, step) > step:
            return None  # a newer checkpoint of this job is queued behind this one
        f = self._files.get(job.id)
        if f is not None:
            try:
                f.flush()  # the metrics rows up to the checkpoint survive a kill
            except OSError as err:
                self._broke(job, "writing metrics.jsonl", err)
        assert self.checkpoint_dir is not None  # (checkpoints are asked for only with a directory)
        path = checkpoint.path_for(self.checkpoint_dir, job_dir(job.name))
        try:
            checkpoint.save(path, step=step, state=state, metrics=metrics, done=done, data_state=data_state,
                            managers=self._managers)
        except Exception as err:  # noqa: BLE001 - the previous checkpoint stays valid
            log.warning("job %r: checkpoint at step %d failed: %s", job.name, step, err)
            self._line(job, f"checkpoint at step {step} failed: {short_error(err)}")
            return None
        return path

    def _close_job(self, job: Any) -> None:
        self._newest_checkpoint.pop(job.id, None)
        for w in self._writers.pop(job.id, ()):
            _quiet_close(w)
        if self.checkpoint_dir is not None:
            try:
                self._managers.close(checkpoint.path_for(self.checkpoint_dir, job_dir(job.name)))
            except Exception as err:  # noqa: BLE001 - the previous checkpoint stays valid
                log.warning("job %r: finishing its last checkpoint failed: %s", job.name, err)
        if self.log_dir is None:
            return
        f = self._files.pop(job.id, None)
        if f is None and job.id not in self._broken:
            self._closed_early.add(job.id)
        _quiet_close(f)


def _quiet_close(f: Any) -> None:
    if f is not None:
        try:
            f.close()
        except Exception as err:  # noqa: BLE001 - a file or a writer; closing never raises
            log.debug("xshare recorder: close failed: %s", err)
