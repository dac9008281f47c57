"""decode-load: D(w) = decode_tokens_active + inflight_decode_tokens, divided by the max over candidates."""

import pytest

from kvmesh.routing.scorers import DecodeLoadScorer, decode_tokens
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_decode_load() -> None:
    a = WorkerView("a", decode_tokens_active=300, inflight_decode_tokens=100)
    b = WorkerView("b", decode_tokens_active=100)
    assert decode_tokens(a) == 400
    out = DecodeLoadScorer().score(RoutingQuery("r", prompt_tokens=1), [a, b], [a, b])
    assert out == pytest.approx([1.0, 0.25])
