"""``xshare serve`` end to end: jobs from another process, seen by ``top``, controlled with
``ctl``, computing exactly what the same jobs compute in-process; refusals change nothing;
SIGTERM checkpoints and exits 0, ``--resume`` finishes the work."""

from __future__ import annotations

import json
import time
import socket

import jax
import numpy as np

import xshare
from xshare.runtime.observe import checkpoint
from xshare.jobs import JobRequest, plan_target, requests_from_plan

from .conftest import TINY, Served

SPEC = """
[[job]]
entry = "xshare.models.mlp:make_job"
steps = 300
params = { lr = [1e-3, 3e-4, 1e-2], width = 16, batch = 8 }

[[job]]
name = "long"
entry = "xshare.models.mlp:make_job"
steps = 100000000
params = { width = 16, batch = 8, seed = 7 }
"""


def final_state(run_dir, name, like, timeout=30.0):
    # A job is "done" in /status when its last step retired; its final checkpoint is written
    # by the service's recorder thread after that (an Orbax save: tens of ms, behind the saves
    # queued before it), so a client that reads it at once may find the one before.
    deadline = time.monotonic() + timeout
    while True:
        saved = checkpoint.load(checkpoint.path_for(run_dir, name), like, job=name)
        if (saved is not None and saved.done) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert saved is not None and saved.done, f"{name}: no final checkpoint"
    return saved


def in_process(requests):
    specs = [r.build(r.name) for r in requests]
    return dict(zip([r.name for r in requests], xshare.run(specs, memory="256MiB"))), specs


def assert_same_tree(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def test_submit_top_cancel_and_equivalence(served: Served):
    spec = served.tmp / "sweep.toml"
    spec.write_text(SPEC)
    sub = served.cli("submit", str(spec))
    assert sub.returncode == 0, sub.stderr
    names = sub.stdout.split()
    assert len(names) == 4 and names[3] == "3_long", names

    top = served.cli("top", "--once", "--json", "--address", served.address)
    assert top.returncode == 0, top.stderr
    shown = {j["name"] for j in json.loads(top.stdout)["jobs"]}
    assert set(names) <= shown

    ctl = served.cli("ctl", "cancel", "3_long")
    assert ctl.returncode == 0, ctl.stderr
    assert "3_long: cancel" in ctl.stdout
    jobs = served.wait_for(lambda js: all(js[n]["status"] in ("done", "cancelled", "failed") for n in names),
                           what="every job to end")
    assert [jobs[n]["status"] for n in names] == ["done", "done", "done", "cancelled"]
    assert all(jobs[n]["steps_done"] == 300 for n in names[:3])

    requests = requests_from_plan(plan_target(str(spec)))[:3]
    expected, specs = in_process(requests)
    for req, spec_ in zip(requests, specs):
        saved = final_state(served.run_dir, req.name, spec_.state)
        state, metrics = expected[req.name]
        assert saved.step == 300
        assert_same_tree(saved.state, state, req.name)  # bit for bit (CPU), like any runtime
    assert (served.run_dir / "0_lr=0.001" / "metrics.jsonl").stat().st_size > 0

    # The same spec again runs again, under new names.
    again = served.cli("submit", "xshare.models.mlp:make_job", "--set", "width=16", "--set", "batch=8",
                       "--steps", "5", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["jobs"][0]["name"] == "0_mlp"


def _unchanged(served: Served, before: dict, why: str) -> None:
    after = served.jobs()
    assert set(after) == set(before), why
    for name, j in before.items():
        assert after[name]["priority"] == j["priority"], why
        if j["status"] in ("done", "cancelled", "failed"):
            assert after[name]["status"] == j["status"], why
        else:
            assert after[name]["status"] not in ("cancelled", "failed"), why


def test_control_refusals_change_nothing(served: Served):
    code, doc = served.http("POST", "/jobs", json.dumps({"jobs": [JobRequest(
        "xshare.models.mlp:make_job", {**TINY}, steps=10**8, name="victim").to_json()]}).encode())
    assert code == 200, doc
    victim = doc["jobs"][0]["name"]
    before = served.jobs()
    good = json.dumps({"jobs": [{"entry": "xshare.models.mlp:make_job", "params": TINY, "steps": 3}]}).encode()

    cases = [  # (method, path, body, token, code, words in the error)
        ("POST", "/jobs", good, None, 401, "Bearer"),                         # no token
        ("POST", "/jobs", good, "wrong", 401, "Bearer"),                      # wrong token
        ("POST", f"/jobs/{victim}/cancel", b"", None, 401, "Bearer"),
        ("POST", f"/jobs/{victim}/pause", b"", "wrong", 401, "Bearer"),
        ("POST", "/jobs", b"{not json", "default", 400, "not JSON"),          # malformed bodies
        ("POST", "/jobs", b'{"jobs": []}', "default", 400, "non-empty"),
        ("POST", "/jobs", b'{"jobs": [{"entry": "nocolon"}]}', "default", 400, "module:function"),
        ("POST", "/jobs", b'{"jobs": [{"entry": "a:b", "stepz": 3}]}', "default", 400, "unknown key 'stepz'"),
        ("POST", f"/jobs/{victim}/priority", b'{"priority": "high"}', "default", 400, "must be an int"),
        ("POST", f"/jobs/{victim}/priority", b'{"priority": 2147483648}', "default", 400, "2147483647"),
        ("POST", f"/jobs/{victim}/priority", b"[1", "default", 400, "not JSON"),
        ("POST", "/jobs/no-such-job/cancel", b"", "default", 404, "no job 'no-such-job'"),  # unknown job
        ("POST", "/jobs/no-such-job/priority", b'{"priority": 1}', "default", 404, "no job"),
        # an entry the service cannot import: its one-line reason, no traceback
        ("POST", "/jobs", b'{"jobs": [{"entry": "no_such_module_xyz:make_job"}]}', "default", 422,
         "no module named 'no_such_module_xyz'"),
        ("POST", "/jobs", json.dumps({"jobs": [{"entry": "xshare.models.mlp:make_job", "params": {"bogus": 1}},
                                               {"entry": "xshare.models.mlp:make_job", "params": TINY}]}).encode(),
         "default", 422, "does not accept parameter 'bogus'"),
    ]
    for method, path, body, token, code, words in cases:
        got, doc = served.http(method, path, body, token=token)
        why = f"{method} {path} {body!r} token={token}"
        assert got == code, (why, got, doc)
        assert words in doc["error"], (why, doc)
        assert "Traceback" not in doc["error"] and "\n" not in doc["error"], (why, doc)
        _unchanged(served, before, why)

    # A body shorter than its Content-Length: 408 after the server's read timeout, nothing changed.
    host, port = served.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {served.token}\r\n"
                     f"Content-Length: 100\r\n\r\n{{\"jobs\"".encode())
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    _unchanged(served, before, "short body")

    # CLI: clear errors for an unknown job, a wrong token and no service at the address.
    r = served.cli("ctl", "cancel", "no-such-job")
    assert r.returncode == 1 and "no job 'no-such-job'" in r.stderr, r.stderr
    r = served.cli("ctl", "pause", victim, "--token", "wrong")
    assert r.returncode == 1 and "refused the token" in r.stderr, r.stderr
    r = served.cli("submit", "xshare.models.mlp:make_job", "--address", "127.0.0.1:9")
    assert r.returncode == 2 and "no xshare service at 127.0.0.1:9" in r.stderr, r.stderr
    r = served.cli("submit", "no_such_module_xyz:make_job")
    assert r.returncode == 1 and "no module named 'no_such_module_xyz'" in r.stderr, r.stderr
    _unchanged(served, before, "cli refusals")

    # A job that can never fit: the admission numbers (the arena is 256 MiB).
    big = json.dumps({"jobs": [{"entry": "xshare.models.mlp:make_job", "steps": 2,
                                "params": {"width": 4096, "depth": 4, "batch": 8}}]}).encode()
    got, doc = served.http("POST", "/jobs", big)
    assert got == 422, doc
    assert "can never fit" in doc["error"] and "MiB" in doc["error"], doc
    assert doc["jobs"][0]["status"] == "failed"

    r = served.cli("ctl", "priority", victim, "5")
    assert r.returncode == 0 and served.jobs()[victim]["priority"] == 5
    assert served.cli("ctl", "cancel", victim).returncode == 0


# A data-bound job: the tiny MLP with each batch ready only after a pause, as a job reading its
# data from a slow disk is. Its run lasts seconds however fast the machine computes, so the
# SIGTERM below lands mid-run by construction. (An unpaced 10,000-step job once finished all its
# steps between the test seeing step 100 and its signal: multi-step calls run it at ~10 us a step.)
PACED = """
import dataclasses, time
from xshare.models import mlp

class Paced:
    def __init__(self, data, seconds):
        self.data, self.seconds = data, seconds

    def __call__(self, step):
        time.sleep(self.seconds)
        return self.data(step)

def make_job(lr=1e-3, width=16, batch=8, steps=200):
    spec = mlp.make_job(lr=lr, width=width, batch=batch, steps=steps)
    return dataclasses.replace(spec, data=Paced(spec.data, 0.0015))
"""


def test_sigterm_checkpoints_exits_0_and_resume_finishes(tmp_path):
    steps = 3_000  # ~4.5 s of paced batches; the signal comes ~0.2 s after step 100
    (tmp_path / "paced_mlp.py").write_text(PACED)  # the service's cwd: importable by it
    first = Served(tmp_path)
    try:
        r = first.cli("submit", "paced_mlp:make_job", "--set", "width=16", "--set", "batch=8",
                      "--set", "lr=3e-3", "--steps", str(steps))
        assert r.returncode == 0, r.stderr
        name = r.stdout.strip()
        first.wait_for(lambda js: js[name]["steps_done"] >= 100, what="100 steps")
        rc, out, err = first.terminate()
    finally:
        first.stop()
    assert rc == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    # The reference: the same MLP and batches, unpaced (pacing changes when a batch comes, not what)
    req = JobRequest("xshare.models.mlp:make_job", {**TINY, "lr": 3e-3}, steps=steps, name=name)
    spec = req.build(name)
    saved = checkpoint.load(checkpoint.path_for(first.run_dir, name), spec.state, job=name)
    assert saved is not None and not saved.done and 100 <= saved.step < steps

    second = Served(tmp_path, "--resume")
    try:
        jobs = second.wait_for(lambda js: js.get(name, {}).get("status") == "done", what="the resumed job")
        assert jobs[name]["steps_done"] == steps
    finally:
        second.stop()
    (state, _), = xshare.run([spec], memory="256MiB")
    done = final_state(second.run_dir, name, spec.state)
    assert done.step == steps
    assert_same_tree(done.state, state, name)
