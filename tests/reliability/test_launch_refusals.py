"""A launch refused at once (exit 2) says why in one line, and leaves nothing behind: no run
directory, no spec.json, no per-job folders; an existing --out keeps exactly what it held."""

from __future__ import annotations

import json
import re
import socket

import pytest

import xshare
from xshare.cli.main import main
from xshare.models import mlp

ENTRY = ["xshare.models.mlp:make_job", "--set", "width=8", "--set", "batch=4", "--steps", "5"]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refused(capsys, *argv) -> str:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_out_pointing_at_a_file(cwd, capsys):
    (cwd / "afile").write_text("x")
    err = _refused(capsys, *ENTRY, "--out", "afile")
    assert "--out afile: afile exists and is not a directory" in err
    err = _refused(capsys, *ENTRY, "--out", "afile/sub")
    assert "afile exists and is not a directory" in err
    assert sorted(p.name for p in cwd.iterdir()) == ["afile"]


@pytest.mark.parametrize("port", ["70000", "-5"])
def test_status_port_out_of_range(cwd, capsys, port):
    err = _refused(capsys, *ENTRY, "--out", "run", "--status-port", port)
    assert f"--status-port {port} must be 1..65535, 0 (any free port) or -1 (off)" in err
    assert list(cwd.iterdir()) == []


def test_status_port_in_use(cwd, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _refused(capsys, *ENTRY, "--out", "run", "--status-port", str(port))
    assert f"127.0.0.1:{port} cannot be bound" in err
    assert list(cwd.iterdir()) == []


def test_memory_too_small_for_any_job_leaves_nothing(cwd, capsys):
    err = _refused(capsys, *ENTRY, "--out", "run/deeper", "--memory", "1KiB")
    assert "but the arena holds 1.0 KiB" in err and "Nothing was run" in err
    assert list(cwd.iterdir()) == []  # run/ and run/deeper/ were made by the launch: gone


def test_memory_too_small_keeps_what_an_existing_out_held(cwd, capsys):
    (cwd / "mine").mkdir()
    (cwd / "mine" / "notes.txt").write_text("keep me")
    _refused(capsys, *ENTRY, "--out", "mine", "--memory", "1KiB")
    assert sorted(p.name for p in (cwd / "mine").iterdir()) == ["notes.txt"]


def test_resume_of_a_spec_json_whose_job_lacks_its_name(cwd, capsys):
    assert main(["launch", *ENTRY, "--out", "run"]) == 0
    capsys.readouterr()
    doc = json.loads((cwd / "run" / "spec.json").read_text())
    del doc["jobs"][0]["name"]
    (cwd / "run" / "spec.json").write_text(json.dumps(doc))
    err = _refused(capsys, "--resume", "run")
    assert "a job in run/spec.json lacks 'name'" in err, err


def test_factory_hyperparameter_of_the_wrong_type_is_named_before_compiling(cwd, capsys):
    with pytest.raises(xshare.SpecError, match=re.escape("mlp: lr='fast' must be a number")):
        mlp.make_job(lr="fast")
    with pytest.raises(xshare.SpecError, match=re.escape("mlp: seed=-1 must be an int >= 0")):
        mlp.make_job(seed=-1)
    err = _refused(capsys, *ENTRY, "--set", "lr=fast", "--out", "run")
    assert "lr='fast'" in err
    assert list(cwd.iterdir()) == []
