"""What log-probabilities and structured outputs cost the router, against its plain path (see `kvmesh.bench.router`).

    python -m kvmesh.bench router [--api http] --logprobs K [--response-format json|json_schema] --max-tokens N ...

Each feature is sent as two more paths of the same `measure` run as the plain ones, on the same workers:
``router+<feature>`` (``kvmesh+<feature>`` over HTTP) and ``direct+<feature>``. The c1 samples go in blocks of
`C1_BLOCK` requests per path in turn (`c1_rounds`: 20 rounds for 200 c1 requests, not the plain bench's 4: a
feature's figure is a difference of two differences, and a slow spell of the shared machine must land on all
the paths alike; not one request each either, which lets one path's after-work, a garbage collection or the
cache-manager's KV events, land on the next path's request) and the concurrency runs alternate (A B, B A).
Per feature and prompt size the JSON line gets (`feature_cost`):

- ``plain_overhead_ms`` / ``feature_overhead_ms``: router c1 p50 − direct c1 p50 without / with the feature;
  ``extra_ms_per_request`` their difference, ``extra_us_per_token`` that over the ``--max-tokens`` generated
  (every request generates exactly that many: `ignore_eos`, checked before the run);
- ``plain_cpu_us_per_request`` / ``feature_cpu_us_per_request``: the router processes' CPU per request over the
  concurrency runs (/proc), ``extra_cpu_us_per_request`` and ``extra_cpu_us_per_token`` their difference: the
  steadier figure on shared cores (the latency difference of two differences carries both paths' noise twice).

``--logprobs K``: the request asks for each token's log-probability and its K most likely alternatives (gRPC
`SamplingParams.logprobs`, HTTP completions' `logprobs: K`); the simulated engine makes synthetic ones
(docs/engine-model.md), so the router's work per token — converting them, into OpenAI's shapes on HTTP — is
real. ``--response-format json`` asks for any JSON object (`json_object`), ``json_schema`` for `BENCH_SCHEMA`.
The simulated engine refuses a grammar (by design), so with either the bench's workers are
`kvmesh.bench.grammar_stand_in` workers — the normal worker with a bench-only engine wrapper that validates the
grammar and then generates the usual synthetic tokens unconstrained: the figures are the router's and the
wire's cost of carrying the grammar, not a grammar engine's (the stand-in is never in serving code).

Before measuring, one request per path is checked (`check_grpc`, `check_http`): `max_tokens` tokens came back,
with K alternatives per token for ``--logprobs``, and for a grammar the stand-in's log shows a worker received
one through the router; a feature the router dropped or refused ends the bench instead of being priced as free.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc

from kvmesh.v1 import common_pb2, router_pb2, worker_pb2

LOGPROBS = "logprobs"
RESPONSE_FORMAT = "response_format"
RESPONSE_FORMATS = ("json", "json_schema")
# what the JSON line says the workers were when a grammar was measured
STAND_IN = "kvmesh.bench.grammar_stand_in: the sim worker accepting the grammar unconstrained (bench-only)"
# a small, typical extraction schema: what a client sends with `json_schema`
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Feature:
    """One feature priced against the plain path: `logprobs` (K alternatives) or `response_format`."""

    name: str
    top_logprobs: int = 0
    response_format: str = ""

    def grpc_sampling(self, plain: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        """The plain request's sampling with this feature on (gRPC API)."""
        sp = common_pb2.SamplingParams()
        sp.CopyFrom(plain)
        if self.name == LOGPROBS:
            sp.logprobs = self.top_logprobs
        elif self.response_format == "json":
            sp.structured_output.json_object = True
        else:
            sp.structured_output.json_schema = json.dumps(BENCH_SCHEMA)
        return sp

    def http_body(self, plain: dict[str, Any]) -> dict[str, Any]:
        """The plain completions body with this feature on (OpenAI HTTP API)."""
        body = copy.copy(plain)
        if self.name == LOGPROBS:
            body["logprobs"] = self.top_logprobs
        elif self.response_format == "json":
            body["response_format"] = {"type": "json_object"}
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
        return body

    @property
    def grammar(self) -> bool:
        return self.name == RESPONSE_FORMAT


def features_from_flags(logprobs: int | None, response_format: str) -> list[Feature]:
    """The features the flags ask for, logprobs first."""
    out = [Feature(LOGPROBS, top_logprobs=logprobs)] if logprobs is not None else []
    return out + ([Feature(RESPONSE_FORMAT, response_format=response_format)] if response_format else [])


C1_BLOCK = 10  # c1 requests a path sends in a row when features are measured (module docstring)


def c1_rounds(features: Sequence[Feature], c1_requests: int) -> int:
    """`measure`'s c1 rounds: the plain bench's 4, or with features blocks of `C1_BLOCK` requests per path."""
    return max(c1_requests // C1_BLOCK, 1) if features else 4


def path(base: str, feature: Feature) -> str:
    """The `measure` path name of `base` ("router", "kvmesh", "direct") with `feature` on."""
    return f"{base}+{feature.name}"


def _get(figures: dict[str, float], key: str) -> float:
    value = figures.get(key)
    if value is None:
        raise KeyError(f"no {key} in {figures}")
    return value


def feature_cost(
    plain_router: dict[str, float],
    plain_direct: dict[str, float],
    feature_router: dict[str, float],
    feature_direct: dict[str, float],
    tokens: int,
) -> dict[str, float]:
    """What the feature adds to the router's overhead (c1 p50) and CPU per request, per request and per token
    (`tokens` generated per request); `measure`'s figures of the four paths. Negative values are noise."""
    plain = _get(plain_router, "c1_p50_ms") - _get(plain_direct, "c1_p50_ms")
    feat = _get(feature_router, "c1_p50_ms") - _get(feature_direct, "c1_p50_ms")
    cpu_plain, cpu_feat = _get(plain_router, "cpu_us_per_request"), _get(feature_router, "cpu_us_per_request")
    return {
        "plain_overhead_ms": round(plain, 3),
        "feature_overhead_ms": round(feat, 3),
        "extra_ms_per_request": round(feat - plain, 3),
        "extra_us_per_token": round((feat - plain) * 1000 / tokens, 2),
        "plain_cpu_us_per_request": cpu_plain,
        "feature_cpu_us_per_request": cpu_feat,
        "extra_cpu_us_per_request": round(cpu_feat - cpu_plain, 1),
        "extra_cpu_us_per_token": round((cpu_feat - cpu_plain) / tokens, 2),
    }


def split_features(
    got: dict[str, dict[str, float]], router: str, features: Sequence[Feature], tokens: int
) -> dict[str, dict[str, Any]]:
    """`measure`'s figures of one prompt size → per feature: its two paths' figures and `feature_cost`."""
    out: dict[str, dict[str, Any]] = {}
    for f in features:
        r, d = got[path(router, f)], got[path("direct", f)]
        out[f.name] = {router: r, "direct": d, **feature_cost(got[router], got["direct"], r, d, tokens)}
    return out


# -- the checks before the run ------------------------------------------------------------------------


class FeatureCheckError(RuntimeError):
    """A path did not serve what the bench asked for: measuring it would price a feature it never ran."""


def check_tokens(
    where: str, ids: int, alts: list[int], feature: Feature | None, tokens: int, merged: bool = False
) -> None:
    """`ids` tokens came back, `alts` = how many alternatives each token's log-probabilities list: exactly K,
    or (`merged`: completions' `{text: logprob}`, where ids that decode alike share a key and the sampled token
    is always listed) 1 to max(K, 1)."""
    if ids != tokens:
        raise FeatureCheckError(f"{where}: {ids} tokens came back, not max_tokens={tokens}")
    if feature is not None and feature.name == LOGPROBS:
        k = feature.top_logprobs
        if len(alts) != tokens:
            raise FeatureCheckError(f"{where}: log-probabilities for {len(alts)} of {tokens} tokens")
        if any(not (1 <= n <= max(k, 1) if merged else n == k) for n in alts):
            raise FeatureCheckError(f"{where}: alternatives per token {alts}, asked for {k}")
    elif alts:
        raise FeatureCheckError(f"{where}: log-probabilities came back unasked")


async def check_grpc(
    router_address: str,
    worker_address: str,
    sampling: common_pb2.SamplingParams,
    features: Sequence[Feature],
    prompt: list[int],
    grammar_seen: Callable[[], bool],
) -> None:
    """One request per path over gRPC (router, then straight to a worker), each checked (module docstring);
    `grammar_seen`: whether a stand-in worker has logged a grammar (asked after the router's only)."""
    tokens = sampling.max_tokens
    async with (
        grpc.aio.insecure_channel(router_address) as rch,
        grpc.aio.insecure_channel(worker_address) as wch,
    ):
        via_router = rch.unary_stream(
            "/kvmesh.v1.RouterService/Generate",
            request_serializer=router_pb2.RouterServiceGenerateRequest.SerializeToString,
            response_deserializer=router_pb2.RouterServiceGenerateResponse.FromString,
        )
        direct = wch.unary_stream(
            "/kvmesh.v1.WorkerService/Generate",
            request_serializer=worker_pb2.GenerateRequest.SerializeToString,
            response_deserializer=worker_pb2.GenerateResponse.FromString,
        )
        for k, f in enumerate([None, *features]):
            sp = sampling if f is None else f.grpc_sampling(sampling)
            ids = common_pb2.TokenIds(ids=[k + 1, *prompt])  # a new first token: no prefix-cache hit from the last
            calls: tuple[tuple[str, Any, Any], ...] = (
                ("router", via_router, router_pb2.RouterServiceGenerateRequest(token_ids=ids, sampling=sp)),
                ("direct", direct, worker_pb2.GenerateRequest(request_id=f"check-{k}", token_ids=ids, sampling=sp)),
            )
            for base, call, req in calls:  # the router first: a grammar a worker has logged came through it
                name = base if f is None else path(base, f)
                try:
                    got = [m async for m in call(req, timeout=60)]
                except grpc.aio.AioRpcError as exc:
                    raise FeatureCheckError(f"{name}: {exc.code().name}: {exc.details()}") from None
                alts = [len(p.top) for m in got for p in m.logprobs]
                check_tokens(name, sum(len(m.token_ids) for m in got), alts, f, tokens)
                if base == "router" and f is not None and f.grammar and not grammar_seen():
                    raise FeatureCheckError(f"{name}: no worker received the structured output through the router")


async def check_http(
    session: aiohttp.ClientSession,
    router_url: str,
    worker_url: str,
    body: dict[str, Any],
    features: Sequence[Feature],
    grammar_seen: Callable[[], bool],
) -> None:
    """`check_grpc` over the OpenAI HTTP API (`POST /v1/completions`, router then a worker)."""
    tokens = int(body["max_tokens"])
    for f in [None, *features]:
        b = body if f is None else f.http_body(body)
        for base, url in (("kvmesh", router_url), ("direct", worker_url)):
            name = base if f is None else path(base, f)
            async with session.post(url + "/v1/completions", json=b) as r:
                text = await r.text()
                if r.status != 200:
                    raise FeatureCheckError(f"{name}: HTTP {r.status}: {text[:300]}")
            got = json.loads(text)
            lp = got["choices"][0].get("logprobs") or {}
            alts = [len(t or {}) for t in lp.get("top_logprobs", [])]
            check_tokens(name, int(got["usage"]["completion_tokens"]), alts, f, tokens, merged=True)
            if base == "kvmesh" and f is not None and f.grammar and not grammar_seen():
                raise FeatureCheckError(f"{name}: no worker received the structured output through the router")
