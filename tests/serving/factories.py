"""Model factories that ``xshare serve --model`` / ``xshare deploy`` import by entry in the tests."""

from __future__ import annotations

from tests.serving.conftest import mlp_spec


def make_mlp(max_batch: int = 16, max_delay_ms: float = 2.0):
    return mlp_spec(max_batch=max_batch, max_delay_ms=max_delay_ms)
