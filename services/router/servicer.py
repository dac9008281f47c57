"""Router servicers: proto <-> domain. Routing itself lives in kvmesh.routing (pure), the request path in core."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc

from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.sampling import check_extensions
from kvmesh.openai.protocol import Message
from kvmesh.rpc.audit import audited
from kvmesh.rpc.validate import non_empty, require
from kvmesh.security.admin import no_unknown_fields
from kvmesh.security.client_keys import bind_tenant
from kvmesh.security.identity import Identity, current_identity
from kvmesh.security.signing import GRPC_METHOD, SIGNATURE_METADATA, TIMESTAMP_METADATA, SignedRequest
from kvmesh.services.router import metrics as m
from kvmesh.services.router.chunks import Chunk
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.router.request import RouterRequest
from kvmesh.telemetry.context import new_request_id, request_id_var
from kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.wire.proto import logprobs_to_proto, sampling_from_proto
from kvmesh.wire.protowire import field_payload
from kvmesh.wire.token_ids import TokenIdArray

SERVICE = "router"  # as the audit log names it
_TOKEN_IDS_FIELD = router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
_PROMPT_SIBLINGS = frozenset(  # text, chat: on the wire with token_ids, the parsed prompt may differ from the bytes
    f.number
    for f in router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"].fields
    if f.number != _TOKEN_IDS_FIELD
)


class WireGenerateRequest(NamedTuple):
    """A Generate request as parsed, with its wire bytes: a token-id prompt is forwarded to the worker as the
    bytes it arrived in (re-serialising 8K token ids costs ~50 µs on the hot path)."""

    message: router_pb2.RouterServiceGenerateRequest
    raw: bytes

    @classmethod
    def parse(cls, raw: bytes) -> WireGenerateRequest:
        return cls(router_pb2.RouterServiceGenerateRequest.FromString(raw), raw)


def add_router_service(servicer: RouterServicer, server: Any) -> None:
    """`router_pb2_grpc.add_RouterServiceServicer_to_server`, except that `Generate` receives a
    `WireGenerateRequest` (the parsed message and its wire bytes)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=WireGenerateRequest.parse,
            response_serializer=router_pb2.RouterServiceGenerateResponse.SerializeToString,
        )
    }
    name = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


_GENERATE = f"/{router_pb2.DESCRIPTOR.services_by_name['RouterService'].full_name}/Generate"
_ADMIN = router_pb2.DESCRIPTOR.services_by_name["RouterAdminService"].full_name


def signed_from(context: grpc.aio.ServicerContext, path: str, body: bytes) -> SignedRequest:
    """The signed parts of a call: `path` (the full method name), the request's wire bytes and the
    `x-kvmesh-signature` / `x-kvmesh-timestamp` metadata (kvmesh.security.signing)."""
    md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    return SignedRequest(GRPC_METHOD, path, body, md.get(SIGNATURE_METADATA), md.get(TIMESTAMP_METADATA))


def api_key_from(context: grpc.aio.ServicerContext) -> str | None:
    """`authorization: Bearer <key>` or `x-api-key: <key>` metadata."""
    for k, v in context.invocation_metadata() or ():
        if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
            return v[7:].strip()
        if k == "x-api-key" and isinstance(v, str):
            return v.strip()
    return None


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Client-facing generation."""

    def __init__(self, front: Frontend) -> None:
        self.front = front

    async def Generate(  # type: ignore[override]
        self, received: WireGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterServiceGenerateResponse]:
        """`received`: the message and its wire bytes (registered by `add_router_service`)."""
        f = self.front
        outcome = "error"
        request, raw = received
        try:
            ident = f.authorize(f.caller_key(api_key_from(context)), signed_from(context, _GENERATE, raw))
            tenant = bind_tenant(ident, request.tenant)  # the cache salt: never another key's tenant
            which = request.WhichOneof("prompt")
            require(which is not None, "prompt", "one of text, token_ids or chat is required")
            f.check_sampling(request.sampling)
            lora = f.lora_for(request.model, request.lora_name)
            if which == "text":
                prompt = await f.tokenize_text(request.text, tenant)
            elif which == "token_ids":  # forwarded as the bytes it arrived in
                prompt_bytes = field_payload(raw, _TOKEN_IDS_FIELD, _PROMPT_SIBLINGS)
                prompt = TokenIdArray.from_message(request.token_ids, prompt_bytes)
            else:
                messages = [Message(msg.role, msg.content) for msg in request.chat.messages]
                prompt = await f.tokenize_chat(messages, tenant)
            rid = request.request_id or request_id_var.get() or new_request_id()
            sampling = sampling_from_proto(request.sampling)
            check_extensions(sampling)  # n, log-probabilities, biases, structured output: vLLM's bounds
            req = RouterRequest.checked(
                f.limits,
                rid,
                prompt,
                sampling,
                session_id=request.session_id,
                tenant=tenant,
                resume_ids=request.resume_token_ids,
                lora=lora,
            )
            async for c in f.generate(req):
                yield _response(c, rid)
            outcome = "ok"
        finally:
            m.REQUESTS.labels("grpc", outcome).inc()


def _response(c: Chunk, rid: str) -> router_pb2.RouterServiceGenerateResponse:
    """A chunk on the client's wire: its sequence index, log-probabilities (the prompt's on the first)."""
    resp = router_pb2.RouterServiceGenerateResponse(
        token_ids=c.token_ids,
        text=c.text,
        finish_reason=c.finish_reason,  # type: ignore[arg-type]
        worker_id=c.worker_id,
        migrations=c.migrations,
        request_id=rid,
        index=c.index,
    )
    if c.logprobs:
        resp.logprobs.extend(logprobs_to_proto(c.logprobs))
    if c.prompt_logprobs:
        resp.prompt_logprobs.extend(logprobs_to_proto(c.prompt_logprobs))
    if c.usage is not None:
        resp.usage.CopyFrom(c.usage)
    return resp


class RouterAdminServicer(router_pb2_grpc.RouterAdminServiceServicer):
    """Operator controls: admin key, strict input (`kvmesh.security.admin`), one audit line per call."""

    def __init__(self, front: Frontend) -> None:
        self.front = front

    def _auth(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> Identity | None:
        """An admin caller (`Frontend.authenticate_admin`): a skeleton-authenticated admin, or an admin API key
        and its signing rules; the signed body is the message re-serialized (these requests hold scalars only,
        so that is the bytes a protobuf client sent)."""
        signed = signed_from(context, f"/{_ADMIN}/{method}", request.SerializeToString())
        return self.front.authenticate_admin(
            self.front.caller_key(api_key_from(context)), signed, f"/{_ADMIN}/{method}"
        )

    async def Rebalance(  # type: ignore[override]
        self, request: router_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RebalanceResponse:
        pw, dw = request.prefill_weight, request.decode_weight
        with audited(SERVICE, "RouterAdminService/Rebalance", prefill_weight=pw, decode_weight=dw):
            self._auth(context, "Rebalance", request)
            no_unknown_fields(request)
            p, d = self.front.rebalance(pw, dw)
            return router_pb2.RebalanceResponse(prefill_weight=p, decode_weight=d)

    async def ListWorkers(  # type: ignore[override]
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        with audited(SERVICE, "RouterAdminService/ListWorkers"):
            self._auth(context, "ListWorkers", request)
            no_unknown_fields(request)
            return self.front.list_workers()

    async def DrainWorker(  # type: ignore[override]
        self, request: router_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainWorkerResponse:
        with audited(
            SERVICE,
            "RouterAdminService/DrainWorker",
            worker_id=request.worker_id,
            drain=request.drain,
            force=request.force,
        ):
            self._auth(context, "DrainWorker", request)
            no_unknown_fields(request)
            non_empty(request.worker_id, "worker_id")
            # the skeleton's identity: a planner's token passes the authorisation table, and is bound by the floor
            in_flight = self.front.drain(request.worker_id, request.drain, request.force, current_identity())
            return router_pb2.DrainWorkerResponse(in_flight=in_flight)

    async def GetGuardrails(  # type: ignore[override]
        self, request: router_pb2.GetGuardrailsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetGuardrailsResponse:
        with audited(SERVICE, "RouterAdminService/GetGuardrails"):
            self._auth(context, "GetGuardrails", request)
            no_unknown_fields(request)
            return router_pb2.GetGuardrailsResponse(guardrails=self._guardrails())

    async def ReloadGuardrails(  # type: ignore[override]
        self, request: router_pb2.ReloadGuardrailsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReloadGuardrailsResponse:
        with audited(SERVICE, "RouterAdminService/ReloadGuardrails") as a:
            self._auth(context, "ReloadGuardrails", request)
            no_unknown_fields(request)
            watch = self.front.guardrails
            if watch is None:
                raise FailedPrecondition("this router runs without guardrails (start it with --guardrails PATH)")
            changed = await watch.reload()
            a["changed"] = changed
            return router_pb2.ReloadGuardrailsResponse(guardrails=self._guardrails(), changed=changed)

    def _guardrails(self) -> router_pb2.GuardrailsState:
        watch = self.front.guardrails
        if watch is None:
            return router_pb2.GuardrailsState(enabled=False)
        rules, version, at = watch.loaded()
        return router_pb2.GuardrailsState(
            enabled=True, path=str(watch.path), rules=rules, version=version, loaded_at=at
        )
