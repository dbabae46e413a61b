"""What the commands that make a run directory share (``launch``, ``launch --ray``, ``tune``):
exit codes, usage errors, the checks made before anything is created, and the run directory
with what was created for it, so a refused run removes exactly that."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def usage_error(message: str, prog: str = "xshare launch") -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cwd_on_path() -> None:
    """Like Hydra: modules next to where the user runs ``xshare`` resolve (``my_exp:make_job``)."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def check_out(out: str | None) -> str | None:
    """Why ``--out`` cannot be a run directory (checked before anything is created), or None."""
    if not out:
        return None
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                return (f"--out {out}: {p} exists and is not a directory; give a new or existing "
                        "directory for the run")
            if not os.access(p, os.W_OK | os.X_OK):
                return f"--out {out}: cannot write in {p}; give a directory you can write to"
            return None
    return None


def check_ports(port: int) -> str | None:
    """Why ``--status-port`` cannot be served (range, or in use on loopback), or None."""
    if port == -1 or port == 0:
        return None
    if not 0 < port <= 65535:
        return f"--status-port {port} must be 1..65535, 0 (any free port) or -1 (off)"
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            return (f"--status-port {port}: 127.0.0.1:{port} cannot be bound ({err.strerror}); "
                    "pick another port, 0 for any free one, or -1 for none")
    return None


class Made:
    """What launch created for a run directory, so that a refused launch removes exactly that
    (a pre-existing --out keeps whatever it held before)."""

    def __init__(self, path: Path, top: Path | None, before: set[str]):
        self.path, self.top, self.before = path, top, before

    def undo(self) -> None:
        import shutil

        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
            return
        for entry in self.path.iterdir() if self.path.is_dir() else ():
            if entry.name not in self.before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def make_run_dir(out: str | None, stem: str) -> tuple[Path, "Made"]:
    if out:
        path = Path(out)
        top = next((p for p in reversed((path, *path.parents)) if not p.exists()), None)
        before = {e.name for e in path.iterdir()} if path.is_dir() else set()
        path.mkdir(parents=True, exist_ok=True)
        return path, Made(path, top, before)
    base = Path("runs") / f"{_dt.datetime.now():%Y%m%d-%H%M%S}-{stem}"
    top = Path("runs") if not Path("runs").exists() else None
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path, Made(path, top or path, set())
        except FileExistsError:  # two launches in the same second
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def resolved(plan: Any, run_dir: Path) -> dict[str, Any]:
    return {
        **plan.to_json(),
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "run_dir": str(run_dir),
        "argv": sys.argv,
    }
