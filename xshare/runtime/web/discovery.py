"""Discovery files: how a runtime announces its status address and control token, and how
``xshare top`` finds the runtimes of this user. Pure Python (no jax, no HTTP): ``top`` imports
it on every start.

A runtime writes ``{pid}-{port}.json`` (mode 0600: the token in it lets the reader pause and
cancel jobs) into :func:`discovery_dir`; :func:`discover` lists those of live processes.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def discovery_dir() -> Path:
    """Where runtimes announce themselves: ``$XSHARE_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/xshare`` (per-user, in memory, cleared at logout), else
    ``~/.cache/xshare/runtimes``."""
    override = os.environ.get("XSHARE_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "xshare"
    return Path.home() / ".cache" / "xshare" / "runtimes"


def loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, it is just not ours
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def clean_stale(directory: Path | None = None) -> list[Path]:
    """Remove the discovery files of processes that are gone (a runtime killed with SIGKILL
    cannot remove its own; the file still holds its token). Files of live processes, and
    files this user cannot read or parse, are left alone. Returns the paths removed."""
    directory = discovery_dir() if directory is None else directory
    removed = []
    try:
        paths = list(directory.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def discover(directory: Path | None = None) -> list[dict[str, Any]]:
    """Discovery records of the runtimes whose process is alive, oldest first. Unreadable or
    malformed files are skipped; those of dead processes (a runtime that was killed) are
    removed (:func:`clean_stale`)."""
    directory = discovery_dir() if directory is None else directory
    clean_stale(directory)
    found = []
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            rec = json.loads(path.read_text())
            pid, address = int(rec["pid"]), str(rec["address"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid):
            found.append({**rec, "pid": pid, "address": address, "path": str(path)})
    found.sort(key=lambda r: (r.get("started") or 0, r["path"]))
    return found


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only, atomically (no one ever sees a
    half-written file, nor the token in a file with looser permissions for a moment)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)  # in case the umask or the filesystem widened it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["discovery_dir", "discover", "clean_stale", "pid_alive", "write_private", "loopback"]
