"""Shared pieces of the status API tests: a real runtime serving real jobs, and an HTTP client.

Jobs read their batches through a data callable that sleeps a little, so they stay alive (and
keep stepping) for as long as a test needs them; ``Runtime.close()`` cancels them at the end.
"""

from __future__ import annotations

import http.client
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import xshare
from tests.helpers import linreg_data, linreg_state, linreg_step

REPO = Path(__file__).resolve().parents[2]
ODD = 'odd "name"/x\\y'   # quotes, a slash and a backslash: URL-quoting and label escaping


def slow_data(delay_s: float, seed: int = 0) -> Callable[[int], Any]:
    data = linreg_data(seed=seed)

    def batch(step: int):
        time.sleep(delay_s)  # keeps the job alive for steps * delay_s seconds
        return data(step)

    return batch


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch) -> Path:
    """A private discovery directory, so tests never see each other's (or anyone's) runtimes."""
    d = tmp_path / "runtimes"
    monkeypatch.setenv("XSHARE_RUNTIME_DIR", str(d))
    return d


@contextmanager
def serving(names=("alpha", "beta", ODD), *, steps: int = 100_000, delay_s: float = 0.004,
            **kwargs: Any) -> Iterator[xshare.Runtime]:
    """A Runtime with a status server on a free port, running one linreg job per name."""
    rt = xshare.Runtime(policy=kwargs.pop("policy", "fair"), memory=kwargs.pop("memory", "64MiB"),
                        status_port=0, **kwargs)
    try:
        rt.submit_many([linreg_step.bind(linreg_state(seed=i), slow_data(delay_s, seed=i), steps=steps,
                                         name=name, priority=i) for i, name in enumerate(names)])
        yield rt
    finally:
        rt.close()


def request(address: str, method: str, path: str, body: bytes | str | None = None, *,
            token: str | None = None, headers: dict[str, str] | None = None,
            timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def get_status(rt_or_address: Any) -> dict[str, Any]:
    address = rt_or_address if isinstance(rt_or_address, str) else rt_or_address.status_server.address
    code, headers, body = request(address, "GET", "/status")
    assert code == 200, body
    assert headers["content-type"] == "application/json"
    return json.loads(body)


def job_row(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in status["jobs"] if j["name"] == name)


def wait_for(predicate: Callable[[], Any], timeout: float = 15, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
