"""The worker's inputs to the cost and cache rules of deploy/prometheus/alerts.yaml: its configured GPUs and GPU-hour
price as gauges (cost itself is a recording rule), and every finished request's prompt tokens split into computed
(prefill) and prefix-cache hits, as the engine reported them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, generate_latest

from kvmesh.core.config import load_settings
from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import Usage
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


def _value(name: str) -> float:
    v = REGISTRY.get_sample_value(name)
    assert v is not None, f"{name} not exported"
    return v


@pytest.fixture
def restore_cost() -> Iterator[None]:
    before = (_value("kvmesh_worker_gpus"), _value("kvmesh_worker_gpu_hour_price_usd"))
    yield
    m.GPUS.set(before[0])
    m.GPU_HOUR_PRICE.set(before[1])


def test_price_settings_default_and_flags() -> None:
    s = load_settings(WorkerSettings, [], env={}, service="worker")
    assert (s.gpus, s.gpu_hour_price) == (1, 3.5)
    s = load_settings(WorkerSettings, ["--gpus", "2"], env={"KVMESH_GPU_HOUR_PRICE": "2.25"}, service="worker")
    assert (s.gpus, s.gpu_hour_price) == (2, 2.25)


@pytest.mark.usefixtures("restore_cost")
def test_configured_cost_is_exported_as_gauges() -> None:
    m.set_cost(2, 2.25)
    text = generate_latest(REGISTRY).decode()
    assert "kvmesh_worker_gpus 2.0" in text.splitlines()
    assert "kvmesh_worker_gpu_hour_price_usd 2.25" in text.splitlines()
    m.set_cost(1, 0.0)  # a free GPU (an owned machine) is a price
    assert (_value("kvmesh_worker_gpus"), _value("kvmesh_worker_gpu_hour_price_usd")) == (1, 0)


@pytest.mark.usefixtures("restore_cost")
@pytest.mark.parametrize(
    ("gpus", "price", "field"), [(0, 3.5, "gpus"), (1, -1.0, "gpu_hour_price"), (1, float("nan"), "gpu_hour_price")]
)
def test_bad_cost_settings_are_refused_naming_the_setting(gpus: int, price: float, field: str) -> None:
    m.set_cost(1, 3.5)
    with pytest.raises(InvalidArgument) as e:
        m.set_cost(gpus, price)
    assert e.value.field == field
    assert (_value("kvmesh_worker_gpus"), _value("kvmesh_worker_gpu_hour_price_usd")) == (1, 3.5)  # unchanged


def test_finished_request_splits_prompt_tokens_into_prefill_and_cached() -> None:
    names = (
        "kvmesh_worker_prompt_tokens_total",
        "kvmesh_worker_prefix_hit_tokens_total",
        "kvmesh_prefill_tokens_total",
        "kvmesh_decode_tokens_total",
    )
    before = [_value(n) for n in names]
    m.observe_finished(Usage(prompt_tokens=1000, cached_tokens=960, completion_tokens=50), "stop")
    m.observe_finished(None, "abort")  # no usage: counted as a request, no tokens
    assert [_value(n) - b for n, b in zip(names, before, strict=True)] == [1000, 960, 40, 50]
