"""The documentation site builds with every warning an error (what .ci/run runs): no broken
link or anchor, no API name mkdocstrings cannot resolve, no malformed page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import blocks


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    cmd = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    proc = subprocess.run([*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=blocks.REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="xshare.Runtime"' in api and 'id="xshare.Runtime.submit"' in api
