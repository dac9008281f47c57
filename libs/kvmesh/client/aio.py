"""Async kvmesh client: weighted router choice from the failover service, retries and stream resume.

`generate(request)` yields one logical stream of ``RouterServiceGenerateResponse``:
* the router is drawn with the endpoint-set weights (`EndpointSet.pick`), skipping routers that
  failed for this request and routers ejected after an UNAVAILABLE: an ejected router is probed
  with ``grpc.health.v1`` every `probe_interval_s` and re-admitted once SERVING (or dropped when the
  endpoint sets no longer list it), so a dead zone is avoided even while the endpoint sets are stale;
* a failure before the first token re-sends the same request (same ``request_id``) to another router;
* a failure after tokens were received re-sends it with ``resume_token_ids`` = every token received
  so far, so the router continues after them and the caller sees each token exactly once;
* with `n > 1` the messages of the request's sequences interleave (each names its `index`, carries its
  `logprobs` when asked for; the first may carry the prompt's `prompt_logprobs`), a finish reason ends its
  own sequence and the stream ends once every sequence has finished; a failure after tokens cannot resume
  several sequences with one `resume_token_ids` and is raised as Unavailable (before any token it is retried
  like any other); a request with a structured output resumes like any other (the worker advances its
  grammar over the resumed tokens);
* once every router has failed for this request, the client waits before it starts over: `retry_backoff_s`,
  doubling each round up to `max_retry_backoff_s`, jittered (a half to the whole of it), within the deadline,
  so that a moment when no zone can serve (a worker restarting in each) is waited out, not spent in a burst;
* at most `max_attempts` sends and `timeout_s` seconds in all; INVALID_ARGUMENT and other caller
  errors are raised at once. Retryable: UNAVAILABLE, ABORTED, CANCELLED (server side),
  RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN and a stream ending with FINISH_REASON_ERROR.

With `api_key` every call carries ``authorization: Bearer <key>``; with `signing_secret` too, every attempt
is signed (``x-kvmesh-signature`` / ``x-kvmesh-timestamp`` over the bytes sent, kvmesh.security.signing), its
timestamp one second past the previous attempt's at least, so a retry never repeats a signature the router's
replay guard has seen.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client.endpoints import EndpointSet
from kvmesh.client.watch import EndpointWatcher
from kvmesh.core.errors import DeadlineExceeded, Unavailable
from kvmesh.discovery.model import ServiceInstance
from kvmesh.rpc.channel import LIVENESS_OPTIONS, ChannelSecurity, open_channel
from kvmesh.security.signing import GRPC_METHOD, signing_headers
from kvmesh.v1 import common_pb2, router_pb2

_GENERATE = f"/{router_pb2.DESCRIPTOR.services_by_name['RouterService'].full_name}/Generate"

log = logging.getLogger(__name__)
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


class _Broken(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AsyncClient:
    def __init__(
        self,
        failover_targets: Sequence[str] = (),
        routers: Sequence[str] = (),
        *,
        max_attempts: int = 6,
        timeout_s: float = 120.0,
        retry_backoff_s: float = 0.05,
        max_retry_backoff_s: float = 2.0,
        probe_interval_s: float = 0.25,
        rng: random.Random | None = None,
        endpoints_timeout_s: float = 10.0,
        on_attempt: Callable[[ServiceInstance], None] | None = None,
        security: ChannelSecurity | None = None,
        api_key: str = "",
        signing_secret: str = "",
        prefer_zone: str = "",
    ) -> None:
        self.security = security or ChannelSecurity()
        self.prefer_zone = prefer_zone  # the client's own zone: its routers first while it takes its full share
        self.api_key = api_key
        self.signing_secret = signing_secret
        self.watcher = EndpointWatcher(
            failover_targets,
            initial=EndpointSet.static(list(routers)) if routers else None,
            security=self.security,
        )
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.max_retry_backoff_s = max_retry_backoff_s
        self.probe_interval_s = probe_interval_s
        self.endpoints_timeout_s = endpoints_timeout_s
        self.rng = rng or random.Random()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._ejected: dict[str, asyncio.Task[None]] = {}
        self.on_attempt = on_attempt
        self.attempts_total = 0
        self.resumes_total = 0

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        await self.watcher.start()
        if not self.watcher.current.router_weights and self.watcher.targets:
            await self.watcher.wait_update(self.watcher.updates, self.endpoints_timeout_s)

    async def close(self) -> None:
        for t in self._ejected.values():
            t.cancel()
        await asyncio.gather(*self._ejected.values(), return_exceptions=True)
        self._ejected.clear()
        await self.watcher.stop()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            ch = open_channel(target, self.security, options=LIVENESS_OPTIONS, propagate=False)
            self._channels[target] = ch
        return ch

    def _metadata(self, body: bytes, after_ts: int) -> tuple[tuple[tuple[str, str], ...], int]:
        """The key and, with a signing secret, the signature of `body` stamped later than `after_ts`; returns
        the metadata and the timestamp used."""
        md: list[tuple[str, str]] = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        ts = max(int(time.time()), after_ts + 1)
        if self.signing_secret:
            signed = signing_headers(self.signing_secret, GRPC_METHOD, _GENERATE, body, ts)
            md += [(k.lower(), v) for k, v in signed.items()]
        return tuple(md), ts

    def _choose(self, failed: set[str]) -> ServiceInstance | None:
        eps = self.watcher.current
        u, uz, zone = self.rng.random(), self.rng.random(), self.prefer_zone
        return eps.pick(u, frozenset(failed | set(self._ejected)), zone, uz) or eps.pick(u, frozenset(failed), zone, uz)

    def _eject(self, rid: str, target: str) -> None:
        if rid not in self._ejected:
            self._ejected[rid] = asyncio.create_task(self._probe(rid, target))

    async def _probe(self, rid: str, target: str, max_probes: int = 2400) -> None:
        """Re-admit `rid` once its health is SERVING; give up when it leaves the endpoint sets."""
        try:
            for _ in range(max_probes):
                await asyncio.sleep(self.probe_interval_s)
                if rid not in self.watcher.current.by_id():
                    return
                try:
                    resp = await health_pb2_grpc.HealthStub(self._channel(target)).Check(
                        health_pb2.HealthCheckRequest(), timeout=max(0.1, self.probe_interval_s)
                    )
                except grpc.aio.AioRpcError:
                    continue
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        finally:
            self._ejected.pop(rid, None)

    async def generate(
        self, request: router_pb2.RouterServiceGenerateRequest
    ) -> AsyncIterator[router_pb2.RouterServiceGenerateResponse]:
        req = router_pb2.RouterServiceGenerateRequest()
        req.CopyFrom(request)
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        received: list[int] = list(req.resume_token_ids)
        n = req.sampling.n or 1
        finished: set[int] = set()
        any_token = False
        deadline = time.monotonic() + self.timeout_s
        failed: set[str] = set()
        last_error = "no router available"
        last_ts = 0
        backoff = self.retry_backoff_s
        for _attempt in range(self.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"request {req.request_id}: {self.timeout_s}s passed ({last_error})")
            choice = self._choose(failed)
            if choice is None and failed:  # every router failed once for this request: back off, start over
                await asyncio.sleep(min(left, backoff * (0.5 + self.rng.random() / 2)))  # jittered, within deadline
                backoff = min(self.max_retry_backoff_s, backoff * 2)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"request {req.request_id}: {self.timeout_s}s passed ({last_error})")
                failed.clear()
                choice = self._choose(failed)
            if choice is None:  # no router known at all: wait for the endpoint sets
                await self.watcher.wait_update(self.watcher.updates, min(left, 1.0))
                continue
            rid, target = choice.id, choice.target
            if self.on_attempt is not None:
                self.on_attempt(choice)
            if received:
                del req.resume_token_ids[:]
                req.resume_token_ids.extend(received)
                self.resumes_total += 1
            self.attempts_total += 1
            body = req.SerializeToString()  # sent as these bytes: the signature covers exactly them
            md, last_ts = self._metadata(body, last_ts)
            try:
                call = self._channel(target).unary_stream(
                    _GENERATE, response_deserializer=router_pb2.RouterServiceGenerateResponse.FromString
                )
                async for msg in call(body, timeout=left, metadata=md):
                    if msg.finish_reason == common_pb2.FINISH_REASON_ERROR:
                        raise _Broken("router reported an engine error")
                    if n == 1:
                        received.extend(msg.token_ids)
                    any_token = any_token or bool(msg.token_ids)
                    if msg.prompt_logprobs:  # received once: a resumed attempt does not ask again
                        req.sampling.ClearField("prompt_logprobs")
                    yield msg
                    if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        finished.add(msg.index)
                        if len(finished) >= n:
                            return
                return  # stream closed cleanly without a finish reason: treat as finished
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"request {req.request_id}: {self.timeout_s}s passed") from e
                if e.code() not in RETRYABLE and e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                last_error = f"{rid}: {e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._eject(rid, target)
            except _Broken as e:
                last_error = f"{rid}: {e.reason}"
            if any_token and n > 1:
                # one resume_token_ids list cannot resume several sequences
                raise Unavailable(f"request {req.request_id}: broke after tokens and cannot resume ({last_error})")
            failed.add(rid)
            log.info(
                "request %s: %s; %s",
                req.request_id,
                last_error,
                "resuming" if received else "retrying on another router",
            )
        raise Unavailable(f"request {req.request_id} failed after {self.max_attempts} attempts: {last_error}")
