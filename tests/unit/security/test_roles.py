"""Per-role rules and admin input, pure: the publisher guard (identity, workers and block budget per stream),
strict admin bodies and messages, and the audit line."""

from __future__ import annotations

import json
import logging

import pytest

from kvmesh.cachemgr.publisher import PublisherGuard, PublishLimits
from kvmesh.core.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvmesh.rpc.audit import AUDIT_LOGGER, audited
from kvmesh.security.admin import UnsupportedMediaType, no_unknown_fields, require_json, typed_fields
from kvmesh.security.identity import CallerRole, Identity, identity_var
from kvmesh.v1 import cache_manager_pb2 as pb

pytestmark = pytest.mark.unit
W = Identity(CallerRole.WORKER, "w1")


def test_guard_identity_known_publishes_only_for_itself() -> None:
    g = PublisherGuard(W, PublishLimits(), 0.0)
    g.admit_worker("w1", "hello.worker_id")
    with pytest.raises(PermissionDenied, match=r"worker:w1.*'w2'"):
        g.admit_worker("w2", "batch.worker_id")
    for other in (Identity(CallerRole.ADMIN, "w1"), Identity(CallerRole.ROUTER, "w1")):
        with pytest.raises(PermissionDenied):
            PublisherGuard(other, PublishLimits(), 0.0).admit_worker("w1", "hello.worker_id")


def test_guard_bounds_workers_per_stream_when_anonymous() -> None:
    g = PublisherGuard(None, PublishLimits(max_workers=2), 0.0)
    for w in ("a", "b", "a", "b"):
        g.admit_worker(w, "hello.worker_id")
    with pytest.raises(ResourceExhausted) as ei:
        g.admit_worker("c", "hello.worker_id")
    assert ei.value.retry_after_s == 1.0 and g.workers == {"a", "b"}


def test_guard_block_bucket_refills_and_names_the_wait() -> None:
    g = PublisherGuard(None, PublishLimits(burst_blocks=100, blocks_per_s=10.0), 0.0)
    g.admit_blocks(90, 0.0)
    with pytest.raises(ResourceExhausted) as ei:
        g.admit_blocks(30, 0.0)
    assert ei.value.retry_after_s == pytest.approx(2.0)  # deficit 20 / 10 per s
    g.admit_blocks(30, 2.0)  # 10 + 2 s · 10 = 30
    g.admit_blocks(100, 100.0)  # refilled to the burst, never above
    with pytest.raises(ResourceExhausted):
        g.admit_blocks(1, 100.0)
    with pytest.raises(ResourceExhausted) as ei:
        PublisherGuard(None, PublishLimits(burst_blocks=100), 0.0).admit_blocks(101, 0.0)
    assert ei.value.retry_after_s == 60.0  # larger than the burst: never fits


@pytest.mark.parametrize("ctype", ["application/json", "Application/JSON; charset=utf-8"])
def test_require_json_accepts_json(ctype: str) -> None:
    require_json(ctype)


@pytest.mark.parametrize("ctype", ["", "text/plain", "application/x-www-form-urlencoded", "application/jsonx"])
def test_require_json_refuses_the_rest(ctype: str) -> None:
    with pytest.raises(UnsupportedMediaType) as ei:
        require_json(ctype)
    assert ei.value.field == "Content-Type"


def test_typed_fields() -> None:
    schema = {"worker_id": str, "drain": bool, "w": float, "n": int}
    assert typed_fields({"worker_id": "x", "drain": False, "w": 1, "n": None}, schema) == {
        "worker_id": "x",
        "drain": False,
        "w": 1.0,
    }
    for body, field in (
        ({"drain": "false"}, "drain"),
        ({"drain": 0}, "drain"),
        ({"w": True}, "w"),
        ({"w": float("inf")}, "w"),
        ({"n": 1.5}, "n"),
        ({"worker_id": 3}, "worker_id"),
        ({"zz": 1, "aa": 2}, "aa, zz"),
    ):
        with pytest.raises(InvalidArgument) as ei:
            typed_fields(body, schema)
        assert ei.value.field == field


def test_no_unknown_fields_names_the_nested_field() -> None:
    no_unknown_fields(pb.SetWarmingPolicyRequest(policy=pb.WarmingPolicy(hot_threshold=3)))
    with pytest.raises(InvalidArgument) as ei:
        no_unknown_fields(pb.SetWarmingPolicyRequest.FromString(b"\x0a\x02\x58\x01"))  # policy { 11: 1 }
    assert ei.value.field == "policy" and "[11]" in ei.value.message
    with pytest.raises(InvalidArgument) as ei:
        no_unknown_fields(pb.WarmPrefixesRequest.FromString(b"\x0a\x03\x0a\x01\x05\x0a\x02\x58\x01"))
    assert ei.value.field == "prompts[1]"
    with pytest.raises(InvalidArgument) as ei:
        no_unknown_fields(pb.CheckpointRequest.FromString(b"\x08\x01"))
    assert ei.value.field == "request"


def test_audit_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    with audited("router", "POST /admin/drain", worker_id="w") as args:
        args["drain"] = True
    token = identity_var.set(Identity(CallerRole.ADMIN, "ops"))
    try:
        with pytest.raises(NotFound), audited("router", "RouterAdminService/DrainWorker", worker_id="nope"):
            raise NotFound("unknown worker")
    finally:
        identity_var.reset(token)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == AUDIT_LOGGER]
    assert [(a["who"], a["action"], a["args"], a["result"]) for a in lines] == [
        ("anonymous", "POST /admin/drain", {"worker_id": "w", "drain": True}, "ok"),
        ("admin:ops", "RouterAdminService/DrainWorker", {"worker_id": "nope"}, "NOT_FOUND"),
    ]
    assert all(a["service"] == "router" and str(a["when"]).endswith("+00:00") for a in lines)
