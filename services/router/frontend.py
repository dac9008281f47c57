"""What gRPC and HTTP share in front of the core: authentication, rate limits, tokenisation, output
guardrails, admin actions."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from kvmesh.core.errors import FailedPrecondition, NotFound, PermissionDenied
from kvmesh.core.sampling import check_penalties, check_temperature, check_top_k, check_top_p
from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.openai.protocol import Message
from kvmesh.routing import Profile, WorkerView
from kvmesh.rpc.validate import in_range, require
from kvmesh.security.client_keys import ClientKey, ClientKeys
from kvmesh.security.identity import CallerRole, Identity, current_identity, identity_var
from kvmesh.security.signing import SignedRequest
from kvmesh.services.router.auth import RateLimiter
from kvmesh.services.router.core import Chunk, RouterCore
from kvmesh.services.router.guarded import OutputGuard
from kvmesh.services.router.guardrails_watch import GuardrailsWatch
from kvmesh.services.router.limits import CoreLimits, check_chat_size, check_text_size
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.tokenize import ChatTemplateOptions, RouterTokenizer
from kvmesh.v1 import common_pb2, router_pb2
from kvmesh.wire.token_ids import TokenIdArray

_INLINE_CHARS = 4096  # shorter texts are tokenised inline (a thread hop costs more than encoding them)


class Frontend:
    """Auth (keys, signatures) → rate limit → tokenise → core → output guardrails, plus the admin operations
    (rebalance, list, drain)."""

    def __init__(
        self,
        core: RouterCore,
        tokenizer: RouterTokenizer,
        keys: ClientKeys,
        limiter: RateLimiter,
        model_name: str,
        lora_adapters: Sequence[str] = (),
        guard: OutputGuard | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.keys = keys
        self.limiter = limiter
        self.model_name = model_name
        self.lora_adapters = tuple(lora_adapters)
        self.guard = guard or OutputGuard()
        self.guardrails: GuardrailsWatch | None = (
            None  # the rule files behind `guard` (--guardrails), for the admin RPCs
        )
        self.drain_floor = DEFAULT_DRAIN_FLOOR  # share of a zone's workers a non-admin drain leaves in rotation

    def generate(self, req: RouterRequest) -> AsyncGenerator[Chunk, None]:
        """The request's stream from the core, through the output guardrails when they are on."""
        chunks = self.core.generate(req)
        if self.guard.rules is None:
            return chunks
        return self.guard.filter(chunks, req.request_id, req.tenant, len(req.prompt), req.sampling.n)

    def caller_key(self, presented: str | None) -> ClientKey | None:
        """The API key presented (`ClientKeys.lookup`); None when the service skeleton already authenticated the
        caller as a client or admin (an mTLS certificate, or a role token in the same header), which
        `authenticate` then binds instead."""
        if _skeleton_client() is not None:
            return None
        return self.keys.lookup(presented)

    def authenticate(
        self, key: ClientKey | None, req: SignedRequest, charge: Callable[[str], None] = lambda _: None
    ) -> Identity | None:
        """`key`'s signing rules on `req` against the wall clock (Unauthenticated), `charge` in between
        (`ClientKeys.verify`); with no key, the skeleton's client or admin identity and its tenants
        (`ClientKeys.for_certificate`). The identity is the call's (`identity_var`) from here on. None: no
        keys configured and no certificate (an open router)."""
        peer = _skeleton_client() if key is None else None
        if peer is not None:
            ident: Identity | None = self.keys.for_certificate(peer)
            charge(peer.id)
        else:
            ident = self.keys.verify(key, req, time.time(), charge)
        if ident is not None:
            identity_var.set(ident)
        return ident

    def authenticate_admin(self, key: ClientKey | None, req: SignedRequest, action: str) -> Identity | None:
        """The caller of an admin operation: the identity the service skeleton authenticated (role token or
        certificate, `kvmesh.rpc.auth`) when it is an admin, else the API key, which must have role
        admin (PermissionDenied naming the role and `action`). None: an open router (no keys, no table)."""
        ident = current_identity()
        if ident is not None and ident.role is CallerRole.ADMIN:
            return ident
        ident = self.authenticate(key, req)
        if ident is not None and ident.role is not CallerRole.ADMIN:
            raise PermissionDenied(f"role {ident.role.value} may not call {action}")
        return ident

    def authorize(self, key: ClientKey | None, req: SignedRequest) -> Identity | None:
        """`authenticate` taking a rate-limit token of the key's id (ResourceExhausted); a signed request the
        limit refuses may be re-sent with the same signature."""
        return self.authenticate(key, req, lambda kid: self.limiter.acquire(kid, time.monotonic()))

    @staticmethod
    def check_sampling(sp: common_pb2.SamplingParams) -> None:
        """gRPC sampling, within the bounds HTTP and the engines use (top_p 0 is the proto's "unset")."""
        check_temperature(sp.temperature)
        check_top_p(sp.top_p, zero_means_unset=True)
        check_top_k(sp.top_k)
        check_penalties(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty or 1.0)

    def lora_for(self, model: str, lora_name: str) -> str:
        """The LoRA adapter a request selects: `lora_name` (gRPC), else `model` when it names an adapter (the
        OpenAI/vLLM convention: an adapter is served as a model of its own); '' = the base model. An unknown
        name is NotFound (HTTP 404, as vLLM answers), so a typo never silently runs the base model."""
        serving = ", ".join([self.model_name, *self.lora_adapters])
        if lora_name:
            if lora_name not in self.lora_adapters:
                raise NotFound(f"unknown LoRA adapter {lora_name!r}: serving {serving}")
            return lora_name
        if not model or model == self.model_name:
            return ""
        if model not in self.lora_adapters:
            raise NotFound(f"unknown model {model!r}: serving {serving}")
        return model

    async def tokenize_text(self, text: str, tenant: str) -> TokenIdArray:
        """Token ids of `text` (InvalidArgument, before any work, when it is longer than any prompt within the
        token limit can be), with their wire bytes; a text `tenant` had tokenised before comes from the cache
        (the bytes it keeps are those a worker request splices in), long texts are encoded on a worker thread
        (HF tokenizers releases the GIL), so the event loop keeps serving and several long prompts tokenise in
        parallel."""
        check_text_size(text, self.limits.max_prompt_chars, "prompt")
        cache = self.tokenizer.cache
        packed = cache.get(text, tenant)
        if packed is not None:
            return TokenIdArray.from_wire(packed)
        if len(text) < _INLINE_CHARS:
            ids = self.tokenizer.encode(text)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)
        prompt = TokenIdArray.of(ids)
        if cache.max_bytes:
            cache.put(text, prompt.wire, tenant)
        return prompt

    async def tokenize_chat(
        self, messages: Sequence[Message], tenant: str, template: ChatTemplateOptions | None = None
    ) -> TokenIdArray:
        """Token ids of a rendered chat (with the request's tools and template options); its message count and
        total size, the tools' included, are checked before rendering."""
        require(len(messages) > 0, "messages", "must not be empty")
        opts = template or ChatTemplateOptions()
        check_chat_size(messages, self.limits.max_chat_messages, self.limits.max_prompt_chars, opts.chars)
        for m in messages:
            require(m.role in ("system", "user", "assistant", "tool"), "messages.role", f"unknown role {m.role!r}")
        text = self.tokenizer.render_chat(
            messages, opts.tools, opts.kwargs, opts.add_generation_prompt, opts.continue_final_message
        )
        return await self.tokenize_text(text, tenant)

    @property
    def limits(self) -> CoreLimits:
        """The router's request limits: what a door's parser bounds, and what `RouterRequest.checked` applies."""
        return self.core.limits

    # ---- admin -------------------------------------------------------------------------------------
    @property
    def profile(self) -> Profile:
        return self.core.profile

    def rebalance(self, prefill_weight: float, decode_weight: float) -> tuple[float, float]:
        """Sets alpha = prefill / (prefill + decode); effective for the next decision."""
        in_range(prefill_weight, "prefill_weight", 0.0)
        in_range(decode_weight, "decode_weight", 0.0)
        require(prefill_weight + decode_weight > 0, "prefill_weight", "prefill_weight + decode_weight must be > 0")
        self.profile.set_weights(prefill_weight=prefill_weight, decode_weight=decode_weight)
        return self.weights()

    def weights(self) -> tuple[float, float]:
        w = self.profile.weights()
        a = next((v for k, v in w.items() if k.endswith(".prefill_weight")), 0.5)
        return a, 1.0 - a

    def drain(self, worker_id: str, drain: bool, force: bool = False, caller: Identity | None = None) -> int:
        """Drains (or undrains) a worker; a drain that would leave its zone with no worker in rotation is
        FailedPrecondition naming the zone unless `force` (`last_in_rotation`). A caller other than an admin
        (the planner) may not take the zone below its floor (`below_floor`), force or not: one stolen or buggy
        service token is never a zone's outage."""
        h = self.core.pool.by_id.get(worker_id)
        if h is None:
            raise NotFound(f"unknown worker {worker_id!r}")
        if drain and caller is not None and caller.role is not CallerRole.ADMIN and not h.view.draining:
            short = below_floor(self.core.pool.views(time.monotonic()), worker_id, self.drain_floor)
            if short is not None:
                left, total, floor = short
                raise PermissionDenied(
                    f"drain_floor: draining {worker_id} would leave {left} of the zone's {total} workers in rotation,"
                    f" below its floor of {floor} for a {caller.role.value} caller; an admin may drain it"
                )
        if drain and not force and not h.view.draining:
            zone = last_in_rotation(self.core.pool.views(time.monotonic()), worker_id)
            if zone is not None:
                raise FailedPrecondition(
                    f"draining {worker_id} would leave zone {zone!r} with no worker in rotation (its others are "
                    "draining, unhealthy or their circuit is open); a drain with force set takes it out anyway"
                )
        h.view.draining = drain
        return h.view.inflight_requests

    def list_workers(self) -> router_pb2.ListWorkersResponse:
        now = time.monotonic()
        views = self.core.pool.views(now)
        self.core.tracker.apply(views)
        out = router_pb2.ListWorkersResponse()
        out.prefill_weight, out.decode_weight = self.weights()
        for h in self.core.pool.handles:
            v = h.view
            st = out.workers.add()
            st.endpoint.id = v.id
            st.endpoint.role = common_pb2.SERVICE_ROLE_WORKER
            st.endpoint.address = h.address
            st.endpoint.zone = v.zone
            st.endpoint.version = v.version
            st.endpoint.meta[WORKER_ROLE_META] = v.role.value
            st.endpoint.health = common_pb2.HEALTH_STATE_PASSING if v.healthy else common_pb2.HEALTH_STATE_CRITICAL
            st.load.CopyFrom(h.last_report)
            st.circuit = h.breaker.view_state(now).value
            st.draining = v.draining
            st.in_flight = v.inflight_requests
            st.selections_total = h.selections_total
        return out


DEFAULT_DRAIN_FLOOR = 0.5


def below_floor(views: Sequence[WorkerView], worker_id: str, share: float) -> tuple[int, int, int] | None:
    """(left in rotation, workers, floor) when draining `worker_id` would leave fewer of the pool's workers
    routable than the floor, max(1, ceil(share · workers)); None otherwise. Only workers that serve a whole
    request count (role both or decode): a prefill worker runs prefill halves only, so it keeps no request
    servable, and draining it leaves every request servable aggregated. Pure."""
    serving = [v for v in views if v.role.decodes]
    if not any(v.id == worker_id for v in serving):
        return None
    total = len(serving)
    floor = max(1, math.ceil(share * total))
    left = sum(1 for v in serving if v.routable and v.id != worker_id)
    return (left, total, floor) if left < floor else None


def last_in_rotation(views: Sequence[WorkerView], worker_id: str) -> str | None:
    """The zone of `worker_id` (as it reports it) when no other worker of this router that serves a whole
    request (role both or decode; see `below_floor`) is routable (healthy, not draining, circuit not open), so
    that draining it leaves the router, and the zone it serves, nothing to route to; None otherwise (also for
    a prefill worker). A router's workers are its zone's (whatever zone a worker names), hence the pool.
    Pure."""
    me = next((v for v in views if v.id == worker_id), None)
    if me is None or not me.role.decodes:
        return None
    if any(v.routable for v in views if v.id != worker_id and v.role.decodes):
        return None
    return me.zone


def _skeleton_client() -> Identity | None:
    """The call's skeleton-authenticated identity (an mTLS certificate or a role token) when it is a client's
    or an admin's."""
    ident = current_identity()
    return ident if ident is not None and ident.role in (CallerRole.CLIENT, CallerRole.ADMIN) else None
