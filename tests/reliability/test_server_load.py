"""The control server under load, loopback only: 200 concurrent requests (status reads,
authorized priority changes, unauthorized state changes) are all answered — no resets — and
nothing changes without the token; a stalled body gets 408, an absurd priority 400, and
clients that hang up make no noise."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

import xshare
from tests.helpers import linreg_data, linreg_state, linreg_step

N_STATUS, N_PRIORITY, N_UNAUTHORIZED = 130, 50, 20


@pytest.fixture
def served():
    data = linreg_data()

    def slow(step):  # jobs that stay live for the whole test (close() cancels them)
        time.sleep(0.005)
        return data(step)

    rt = xshare.Runtime(policy="priority", memory="256MiB", status_port=0)
    try:
        rt.submit_many([linreg_step.bind(linreg_state(seed=i), slow, steps=10**6, name=f"j{i}") for i in range(4)]
                       + [linreg_step.bind(linreg_state(seed=9), slow, steps=10**6, name="guarded")])
        assert rt.status_server.host == "127.0.0.1"
        deadline = time.monotonic() + 30
        while any(h.status() != "running" for h in rt.jobs):
            assert time.monotonic() < deadline, [h.status() for h in rt.jobs]
            time.sleep(0.01)
        yield rt
    finally:
        rt.close()


def _request(rt, method, path, body=None, token=None, timeout=30.0):
    host, port = rt.status_server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_200_concurrent_requests_all_answered_and_nothing_changes_without_the_token(served, caplog):
    caplog.set_level(logging.WARNING)
    rt = served
    token = rt.status_server.token
    before = {h.name: (h.status(), h._rec.priority) for h in rt.jobs}
    calls = ([("GET", "/status", None, None)] * N_STATUS
             + [("POST", f"/jobs/j{i % 4}/priority", {"priority": 100 + i}, token) for i in range(N_PRIORITY)]
             + [("POST", f"/jobs/guarded/{a}", {"priority": 7} if a == "priority" else None, t)
                for i in range(N_UNAUTHORIZED)
                for a, t in [(("pause", "cancel", "priority")[i % 3], (None, "wrong-token")[i % 2])]])
    assert len(calls) == 200
    start = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def one(k, call):
        start.wait(30)
        try:
            results[k] = _request(rt, *call)
        except OSError as err:  # a reset or refused connection
            results[k] = err

    threads = [threading.Thread(target=one, args=(k, c)) for k, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    failed = [(calls[k][:2], r) for k, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == [], f"{len(failed)} connections failed: {failed[:5]}"
    codes = [r[0] for r in results]
    assert codes[:N_STATUS] == [200] * N_STATUS
    assert codes[N_STATUS:N_STATUS + N_PRIORITY] == [200] * N_PRIORITY
    assert codes[N_STATUS + N_PRIORITY:] == [401] * N_UNAUTHORIZED
    for r in results[:N_STATUS]:
        assert json.loads(r[1])["schema"] == "xshare.status/v1"
    # The authorized changes landed (the last one per job wins); the guarded job is untouched.
    prios = {h.name: h._rec.priority for h in rt.jobs}
    for i in range(4):
        assert prios[f"j{i}"] in {100 + k for k in range(N_PRIORITY) if k % 4 == i}
    assert (rt.handle("guarded").status(), prios["guarded"]) == before["guarded"]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("xshare.server")] == []


def test_stalled_body_gets_408_and_an_absurd_priority_400(served):
    rt = served
    host, port = rt.status_server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /jobs/j0/priority HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                  b"Authorization: Bearer " + rt.status_server.token.encode() + b"\r\n\r\n{\"prio")
        t = time.monotonic()
        answer = s.recv(4096)
        assert time.monotonic() - t < 20
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    code, body = _request(rt, "POST", "/jobs/j0/priority", {"priority": 10**400}, rt.status_server.token)
    assert code == 400 and b"must be an int in" in body
    assert rt.handle("j0")._rec.priority == 0


def test_clients_that_hang_up_make_no_noise(served, caplog):
    caplog.set_level(logging.WARNING)
    rt = served
    host, port = rt.status_server.address.rsplit(":", 1)
    for k in range(20):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            if k % 2:
                s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")  # then close before reading
            else:
                s.sendall(b"GET /sta")  # half a request line
    code, _ = _request(rt, "GET", "/status")
    assert code == 200
    time.sleep(0.2)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("xshare.server")] == []


def test_a_client_that_never_finishes_its_request_head_is_disconnected(monkeypatch):
    from xshare.runtime.web import server

    monkeypatch.setattr(server, "HEADER_TIMEOUT_S", 0.5)
    rt = xshare.Runtime(memory="64MiB", status_port=0)
    try:
        host, port = rt.status_server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"GET /sta")  # half a request line, then silence
            assert s.recv(100) == b""  # closed by the server (the 30 s socket timeout would raise)
        code, _ = _request(rt, "GET", "/status")  # and the server serves on
        assert code == 200
    finally:
        rt.close()
