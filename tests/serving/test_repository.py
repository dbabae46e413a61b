"""A model repository served as tritonserver serves one: ``xshare serve --model-repository DIR``
in a subprocess, its index, load and unload through tritonclient.http and tritonclient.grpc
(load and unload need the token), and the three model control modes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import xshare
from tests.service.conftest import Served
from tests.serving.conftest import D_IN, direct_mlp, infer_mlp, rows
from xshare.service.repository import Repository


def entry(repo: Path, name: str, text: str) -> None:
    (repo / name).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.toml").write_text(text)


def make_repo(repo: Path) -> Path:
    entry(repo, "mlp", 'entry = "tests.serving.factories:make_mlp"\n')
    entry(repo, "small", 'entry = "tests.serving.factories:make_mlp"\n[params]\nmax_batch = 4\n')
    entry(repo, "broken", 'entry = "tests.serving.factories:nope"\n')
    return repo


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repository")
    repo = make_repo(tmp / "models")
    s = Served(tmp, "--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "mlp",
               "--grpc-port", "0")
    s.repo = repo
    s.grpc_address = json.loads((s.run_dir / "service.json").read_text())["grpc_address"]
    yield s
    s.stop()


def states(index: list[dict]) -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["state"], m.get("reason", "")) for m in index}


def test_index_load_and_unload_over_http_and_grpc(service):
    auth = {"Authorization": f"Bearer {service.token}"}
    h = httpclient.InferenceServerClient(service.address)
    g = grpcclient.InferenceServerClient(service.grpc_address)
    try:
        assert states(h.get_model_repository_index()) == {
            "broken": ("UNAVAILABLE", "not loaded"), "mlp": ("READY", ""), "small": ("UNAVAILABLE", "not loaded")}
        np.testing.assert_array_equal(infer_mlp(h, rows(3))["y"], direct_mlp(rows(3))["y"])

        with pytest.raises(InferenceServerException, match="needs 'Authorization: Bearer <token>'"):
            h.load_model("small")  # changing what is served needs the token, as every change does
        h.load_model("small", headers=auth)
        assert h.is_model_ready("small") and h.get_model_config("small")["max_batch_size"] == 4
        x = rows(4, seed=2)
        i = grpcclient.InferInput("x", [4, D_IN], "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_array_equal(g.infer("small", [i]).as_numpy("y"), direct_mlp(x)["y"])

        with pytest.raises(InferenceServerException, match="has no function 'nope'") as info:
            h.load_model("broken", headers=auth)
        assert info.value.status() == "400"
        index = states(h.get_model_repository_index())
        assert index["broken"][0] == "UNAVAILABLE" and "has no function 'nope'" in index["broken"][1]
        with pytest.raises(InferenceServerException, match="no entry 'ghost' in the model repository"):
            h.load_model("ghost", headers=auth)
        with pytest.raises(InferenceServerException, match="load takes no parameter 'config': the entry's "
                                                           "config.toml is what loads"):
            h.load_model("small", headers=auth, config='{"max_batch_size": 2}')

        over_grpc = g.get_model_repository_index(as_json=True)["models"]
        assert {m["name"]: m["state"] for m in over_grpc} == {"broken": "UNAVAILABLE", "mlp": "READY",
                                                               "small": "READY"}
        with pytest.raises(InferenceServerException) as info:
            g.unload_model("small")
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        g.unload_model("small", headers={"authorization": f"Bearer {service.token}"})
        assert not g.is_model_ready("small")
        with pytest.raises(InferenceServerException) as info:
            g.infer("small", [i])
        assert info.value.status() == "StatusCode.NOT_FOUND"
        assert states(h.get_model_repository_index(headers={}))["small"] == ("UNAVAILABLE", "unloaded")

        # a load reads the entry again: a changed config takes effect (a reload)
        entry(service.repo, "small", 'entry = "tests.serving.factories:make_mlp"\n[params]\nmax_batch = 8\n')
        with pytest.raises(InferenceServerException, match="load takes no parameter 'config'") as info:
            g.load_model("small", headers={"authorization": f"Bearer {service.token}"}, config='{"max_batch_size": 2}')
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        g.load_model("small", headers={"authorization": f"Bearer {service.token}"})
        assert g.get_model_config("small", as_json=True)["config"]["max_batch_size"] == 8
        assert h.is_model_ready("mlp")  # the others served on throughout
    finally:
        h.close()
        g.close()


def test_mode_none_loads_every_entry_and_refuses_load_and_unload(tmp_path):
    repo = make_repo(tmp_path / "models")
    with xshare.Runtime(memory="256MiB") as rt:
        r = Repository(rt, repo, "none")
        assert sorted(rt.models) == ["mlp", "small"]
        index = states(r.index())
        assert index["broken"][0] == "UNAVAILABLE" and "has no function 'nope'" in index["broken"][1]
        assert [m["name"] for m in r.index(ready_only=True)] == ["mlp", "small"]
        with pytest.raises(xshare.InferError, match="the model control mode is none; start xshare serve with "
                                                    "--model-control-mode explicit") as info:
            r.unload("mlp")
        assert info.value.code == 409 and sorted(rt.models) == ["mlp", "small"]


def test_mode_poll_follows_the_directory(tmp_path):
    repo = make_repo(tmp_path / "models")
    with xshare.Runtime(memory="256MiB") as rt:
        r = Repository(rt, repo, "poll", poll_s=3600)  # scans by hand below, not on the clock
        try:
            assert sorted(rt.models) == ["mlp", "small"]
            entry(repo, "late", 'entry = "tests.serving.factories:make_mlp"\n[params]\nmax_batch = 2\n')
            shutil.rmtree(repo / "small")
            r.scan()
            assert sorted(rt.models) == ["late", "mlp"] and rt.model("late").spec.max_batch == 2
            assert "small" not in states(r.index())
            with pytest.raises(xshare.InferError, match="the model control mode is poll"):
                r.load("small")
        finally:
            r.close()


def test_a_model_unloaded_by_a_request_while_a_scan_unloads_it_does_not_stop_the_scan(tmp_path):
    """A ``DELETE /models/{name}`` (under the service's lock, not the repository's) may undeploy a
    model between the scan's look and its own undeploy: the scan's undeploy then raised KeyError,
    which ended the scan with the entries after it left as they were."""
    repo = make_repo(tmp_path / "models")
    with xshare.Runtime(memory="256MiB") as rt:
        r = Repository(rt, repo, "poll", poll_s=3600)
        undeploy, raced = rt.undeploy, []

        def a_request_got_there_first(name, version=None):
            if not raced:
                raced.append(name)
                undeploy(name)  # the racing request's
            undeploy(name, version)  # the scan's own: KeyError when the request got there first

        try:
            rt.undeploy = a_request_got_there_first
            shutil.rmtree(repo / "mlp")
            shutil.rmtree(repo / "small")
            r.scan()
            assert raced == ["mlp"] and sorted(rt.models) == []  # both gone: the scan went on
            assert "mlp" not in states(r.index()) and "small" not in states(r.index())
        finally:
            r.close()


def test_bad_repositories_are_refused_with_the_fix(tmp_path):
    with xshare.Runtime(memory="64MiB") as rt:
        with pytest.raises(xshare.XShareError, match="is not a directory"):
            Repository(rt, tmp_path / "nowhere")
        with pytest.raises(ValueError, match="choose one of none, explicit, poll"):
            Repository(rt, tmp_path, "sometimes")
        entry(tmp_path, "odd", 'entry = "tests.serving.factories:make_mlp"\nmax_batch = 2\n')
        r = Repository(rt, tmp_path, "none")
        assert "unknown key 'max_batch'; a repository entry has entry, params" in states(r.index())["odd"][1]
