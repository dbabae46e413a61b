"""A model repository: a directory with one entry per model, served as Triton serves
``--model-repository DIR`` (its repository extension: index, load, unload; HTTP and gRPC).

Layout (Triton's, with a TOML config in place of ``config.pbtxt``; the model is named after its
directory)::

    DIR/
      digits/
        config.toml      entry = "xshare.models.inference:make_model"
                         [params]          # keyword arguments of the factory
                         max_batch = 32
      mlp/
        config.toml

``entry`` names a model factory (``module:function`` returning ``xshare.model(...)``), as
``xshare serve --model`` and ``xshare deploy`` take it, importable where the service runs;
``params`` are its keyword arguments. (Not a ``model.py`` inside the entry, as Triton's Python
backend has: two entries' ``model`` modules would be one module to Python's import system.)

Model control modes, as Triton defines them:

* ``none`` (the default): every entry is loaded at start; load and unload are refused.
* ``explicit``: only the entries named with ``--load-model`` (``*`` = all) load at start; the
  repository API loads and unloads any entry by name.
* ``poll``: every entry is loaded at start, and the directory is scanned every
  ``poll_s`` seconds: a new entry loads, a changed ``config.toml`` reloads, a removed entry
  unloads. Load and unload by API are refused (as Triton refuses them while polling).

A load reads the entry's ``config.toml`` again, so a changed config takes effect; loading a
model that is loaded reloads it (unload, then deploy: requests in between get 404/503). An entry
that fails (no such entry point, its factory raised, it does not fit) stays ``UNAVAILABLE`` in
the index with the reason.
"""

from __future__ import annotations

import logging
import threading
import tomllib
from pathlib import Path
from typing import Any

from .._errors import SpecError, XShareError
from ..serving.spec import NAME_RE, InferError

log = logging.getLogger("xshare.serving")

CONFIG = "config.toml"
MODES = ("none", "explicit", "poll")
KEYS = ("entry", "params")


def read_entry(directory: Path) -> Any:
    """An entry's ``config.toml`` as a ``ModelRequest`` named after the directory; SpecError says why."""
    from .jobs import RequestError
    from .models import ModelRequest

    path = directory / CONFIG
    name = directory.name
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path} is missing; a repository entry holds {CONFIG} with entry = \"module:function\"") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise SpecError(f"{path}: {err}") from None
    unknown = [k for k in doc if k not in KEYS]
    if unknown:
        raise SpecError(f"{path}: unknown key {unknown[0]!r}; a repository entry has {', '.join(KEYS)}")
    if "entry" not in doc:
        raise SpecError(f"{path}: missing entry = \"module:function\" (a factory returning xshare.model(...))")
    try:
        return ModelRequest(doc["entry"], doc.get("params", {}), name)
    except RequestError as err:
        raise SpecError(f"{path}: {err}") from None


class Repository:
    """The models of a repository directory on a runtime; the repository extension's backend."""

    def __init__(self, rt: Any, directory: str | Path, mode: str = "none", *, load: tuple[str, ...] = (),
                 poll_s: float = 15.0):
        self.rt, self.dir = rt, Path(directory)
        if mode not in MODES:
            raise ValueError(f"model control mode {mode!r}; choose one of {', '.join(MODES)}")
        if not self.dir.is_dir():
            raise XShareError(f"--model-repository {str(self.dir)!r} is not a directory; give the directory "
                              f"that holds one folder per model (each with its {CONFIG})")
        if load and mode != "explicit":
            raise ValueError(f"--load-model needs --model-control-mode explicit (the mode is {mode})")
        if not isinstance(poll_s, (int, float)) or poll_s <= 0:
            raise ValueError(f"poll_s={poll_s!r} must be a number of seconds > 0")
        self.mode, self.poll_s = mode, float(poll_s)
        self._lock = threading.Lock()       # one load/unload at a time: index, deploys and reasons agree
        self._reasons: dict[str, str] = {}  # an entry's last failure (or that it was unloaded)
        self._seen: dict[str, float] = {}  # entries loaded (or tried, in poll mode) -> config.toml's mtime
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        names = self.entries() if mode != "explicit" or "*" in load else list(load)
        for name in names:
            try:
                self._load(name)
            except InferError as err:  # start anyway: the index says why (as Triton does)
                log.warning("model repository: %s", err.message)
        if mode == "poll":
            self._thread = threading.Thread(target=self._poll, name="xshare-repository-poll", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- the repository extension
    def entries(self) -> list[str]:
        """The entries' names: the directories of the repository that look like model names."""
        return sorted(p.name for p in self.dir.iterdir() if p.is_dir() and NAME_RE.match(p.name))

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: each entry's name, version, state (READY/UNAVAILABLE), reason."""
        models = self.rt.models
        out = []
        for name in self.entries():
            handle = models.get(name)
            ready = handle is not None and handle.ready()
            if ready_only and not ready:
                continue
            reason = "" if ready else self._reasons.get(name, "not loaded")
            out.append({"name": name, "version": "1", "state": "READY" if ready else "UNAVAILABLE",
                        "reason": reason})
        return out

    def load(self, name: str) -> None:
        """Load (or reload) entry ``name``; ``InferError`` 404 no such entry, 409 the mode forbids
        it, 400 it failed (its reason, also in the index)."""
        self._allowed("load")
        self._load(name)

    def unload(self, name: str) -> None:
        self._allowed("unload")
        with self._lock:
            if name not in self.rt.models:
                raise InferError(400, f"model {name!r} is not loaded; loaded: {', '.join(sorted(self.rt.models)) or '(none)'}")
            self.rt.undeploy(name)
            self._seen.pop(name, None)
            self._reasons[name] = "unloaded"
        log.info("model repository: unloaded %r", name)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- internals
    def _allowed(self, what: str) -> None:
        if self.mode != "explicit":
            raise InferError(409, f"{what} is refused: the model control mode is {self.mode}; start xshare serve "
                                  "with --model-control-mode explicit to load and unload models by name")

    def _load(self, name: str) -> None:
        if not isinstance(name, str) or not NAME_RE.match(name) or not (self.dir / name).is_dir():
            raise InferError(404, f"no entry {name!r} in the model repository {self.dir}; entries: "
                                  f"{', '.join(self.entries()) or '(none)'}")
        with self._lock:
            try:
                mtime = (self.dir / name / CONFIG).stat().st_mtime
            except OSError:
                mtime = 0.0
            try:
                spec = read_entry(self.dir / name).build()
                if self._unload(name):  # a reload: the new config replaces the old model
                    self._seen.pop(name, None)
                self.rt.deploy(spec)
            except (XShareError, ValueError, TypeError) as err:
                self._reasons[name] = str(err)
                raise InferError(400, f"model {name!r} failed to load: {err}") from None
            self._seen[name] = mtime
            self._reasons.pop(name, None)
        log.info("model repository: loaded %r", name)

    def _unload(self, name: str) -> bool:
        """Undeploy ``name`` if it is deployed; whether it was. A ``DELETE /models/{name}``
        (the service's lock, not this one) may undeploy it between the look and the undeploy:
        then it is gone, as asked, and the scan goes on rather than stopping at a KeyError."""
        if name not in self.rt.models:
            return False
        try:
            self.rt.undeploy(name)
        except KeyError:
            return False
        return True

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.scan()
            except Exception as err:  # noqa: BLE001 - a bad scan must not end polling
                log.warning("model repository: polling %s failed: %s", self.dir, err)

    def scan(self) -> None:
        """One poll: load new and changed entries, unload removed ones."""
        present = set(self.entries())
        for name in sorted(present):
            try:
                mtime = (self.dir / name / CONFIG).stat().st_mtime
            except OSError:
                continue
            if self._seen.get(name) != mtime:
                try:
                    self._load(name)
                except InferError as err:  # its reason is in the index; tried again when its config changes
                    log.warning("model repository: %s", err.message)
                    self._seen[name] = mtime
        for name in sorted(set(self._seen) - present):
            with self._lock:
                self._unload(name)
                self._seen.pop(name, None)
                self._reasons.pop(name, None)
            log.info("model repository: %r left the repository; unloaded", name)


__all__ = ["Repository", "read_entry", "MODES", "CONFIG"]
