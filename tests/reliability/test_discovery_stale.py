"""Discovery files of dead processes (a launch killed with SIGKILL) are removed by the next
`xshare top` (``discover``) or launch (``clean_stale``); live ones and unreadable ones stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from xshare.runtime.web.discovery import clean_stale, discover


def test_stale_files_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{dead.pid}-1234.json").write_text(json.dumps(
        {"pid": dead.pid, "address": "127.0.0.1:1234", "token": "secret"}))
    (tmp_path / f"{os.getpid()}-1235.json").write_text(json.dumps(
        {"pid": os.getpid(), "address": "127.0.0.1:1235", "token": "t"}))
    (tmp_path / "garbage.json").write_text("{not json")
    found = discover(tmp_path)  # what `xshare top` calls
    assert [r["address"] for r in found] == ["127.0.0.1:1235"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{os.getpid()}-1235.json", "garbage.json"])
    assert clean_stale(tmp_path) == []
