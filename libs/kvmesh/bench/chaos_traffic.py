"""The chaos campaign's traffic: open-loop arrivals of a mixed request set, each one a `RequestRecord`.

Arrivals come at `base_rps` (x `rate_factor` during a burst; exponential gaps from the campaign's seed), at
most `max_in_flight` at once (an arrival past that is counted in `shed`, not sent: the campaign bounds its own
load). Each picks a kind:

* ``session``: turn k of one of `sessions` multi-turn sessions (`kvmesh.bench.failover.session_prompt`: a
  system prompt all share, the session's own context, a new question), through `kvmesh.client.AsyncClient`
  following both zones' failover services; greedy with no sampling seed (the engine seeds it from the prompt;
  `seeded_sessions` gives them one), answers twice as long as the others;
* ``short`` / ``long``: a fresh prompt of 16-64 / 1500-3000 tokens, greedy with a sampling seed;
* ``n2``: two sampled sequences (temperature 0.8, a seed; not with a real engine, see below);
* ``http`` / ``http_stream``: the router's OpenAI API (``/v1/completions``, token-id prompt, greedy, a seed),
  whole or as server-sent events, to either zone's router; a failure there (connection, 5xx, 429) is retried
  on the other zone's router until the deadline (the HTTP API has no client library of its own).

The simulated engine cannot follow a structured output (it refuses one as INVALID_ARGUMENT), so there is no
structured-output request in the mix. Every gRPC request may be sent twice by the campaign: once more after
its client gave up with a retryable error (a stream with n > 1 broken after tokens cannot be resumed by the
client and ends that way). Tokens are compared with `chaos_check.reference_tokens` (HTTP: its text, decoded
by the simulated worker's byte tokenizer). With a real engine (`real_vocab`: its vocabulary) prompts stay
inside its vocabulary, every request is greedy and there is no ``n2`` (vLLM refuses n > 1 at temperature 0,
and its CPU sampler draws seed-dependent tokens even at `top_k` 1: no one right answer), and `expected` is None
until the campaign's reference run (`kvmesh.bench.chaos_reference`).

`fill(worker, until)` is the ``pool_full`` fault: long prompts straight to one worker's Generate, at most
`FILL_IN_FLIGHT` at once, until its KV pool is full and past.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import grpc.aio

from kvmesh.bench.chaos_check import HANG_SLACK_S, RequestRecord, reference_tokens, retryable
from kvmesh.bench.chaos_suite import CLIENT, Suite
from kvmesh.bench.failover import session_prompt
from kvmesh.client import AsyncClient
from kvmesh.core.errors import KvmeshError
from kvmesh.discovery.model import ServiceInstance
from kvmesh.engine.tokenizer import ByteTokenizer
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MIX = {"session": 0.35, "short": 0.15, "long": 0.1, "n2": 0.1, "http": 0.15, "http_stream": 0.15}
FILL_IN_FLIGHT = 8
FILL_PROMPT_TOKENS = 3800
VOCAB = 128256  # the simulated worker's vocabulary (no model given)


@dataclass
class TrafficConfig:
    seed: int
    base_rps: float = 3.0
    max_in_flight: int = 24
    deadline_s: float = 30.0
    sessions: int = 8
    context_tokens: int = 1024
    max_tokens: int = 24
    seeded_sessions: bool = False  # True: sessions carry a sampling seed like the other requests
    # a real engine's vocabulary (prompts' token ids stay below it); with one, every request is greedy (n2:
    # two greedy sequences) and its reference comes from the engine after the run (`expected` None until then)
    real_vocab: int = 0


def _code(e: BaseException) -> str:
    """The gRPC status name of a failure (domain errors carry theirs)."""
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name
    if isinstance(e, KvmeshError):
        return str(getattr(e, "code", type(e).__name__)).upper().replace("STATUSCODE.", "")
    if isinstance(e, asyncio.TimeoutError):
        return "DEADLINE_EXCEEDED"
    return type(e).__name__


class Traffic:
    def __init__(self, suite: Suite, config: TrafficConfig, t0: float) -> None:
        self.suite, self.config, self.t0 = suite, config, t0
        self.rng = random.Random(config.seed * 7919 + 1)
        self.records: list[RequestRecord] = []
        self.rate_factor = 1.0
        self.shed = 0
        self.in_flight = 0
        self._idle: asyncio.Queue[int] = asyncio.Queue()
        self._clients: list[AsyncClient] = []
        self._current: dict[int, RequestRecord] = {}
        self._turns = [0] * config.sessions
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._counter = 0
        # no n > 1 on a real engine: vLLM refuses it at temperature 0, and its CPU sampler draws other tokens per
        # seed even at top_k 1, so such a request has no one right answer there (the simulated runs carry it)
        self.mix = {k: w for k, w in MIX.items() if not (config.real_vocab and k == "n2")}
        self.tokenizer = ByteTokenizer()  # the simulated worker's (a real engine's texts come from its reference run)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def start(self) -> None:
        """The client pool (one AsyncClient per request in flight, so that its attempts are the request's)."""
        token = self.suite.tokens[CLIENT.id]
        order = self.suite.failover_addresses()
        for k in range(self.config.max_in_flight):
            home = "ab"[k % 2]
            targets = order[k % 2 :] + order[: k % 2]
            c = AsyncClient(
                targets,
                timeout_s=self.config.deadline_s,
                max_attempts=12,
                on_attempt=self._recorder(k),
                prefer_zone=home,
                api_key=token,
                rng=random.Random(self.config.seed * 31 + k),
            )
            await c.start()
            self._clients.append(c)
            self._idle.put_nowait(k)
        deadline = time.monotonic() + 60
        for c in self._clients:  # every client sees both zones' routers before the campaign starts
            while len(c.watcher.current.router_weights) < 2:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("the campaign's clients did not see both routers within 60 s")
                await c.watcher.wait_update(c.watcher.updates, left)
        self._http = aiohttp.ClientSession(headers={"authorization": f"Bearer {token}"})

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._clients:
            await c.close()
        if self._http is not None:
            await self._http.close()

    def _recorder(self, k: int) -> Callable[[ServiceInstance], None]:
        def rec(inst: ServiceInstance) -> None:
            r = self._current.get(k)
            if r is not None:
                r.attempts += 1
                r.note(self.now(), f"attempt {r.attempts} via {inst.id} (zone {inst.zone})")

        return rec

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, until: float) -> None:
        """Arrivals until `until` (campaign seconds), then waits for every request sent (each bounded by its
        deadline)."""
        while self.now() < until:
            await asyncio.sleep(min(self.rng.expovariate(self.config.base_rps * self.rate_factor), until - self.now()))
            if self.now() >= until:
                break
            kind = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            if self.in_flight >= self.config.max_in_flight:
                self.shed += 1
                continue
            self._spawn(self.one(kind))
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def _rid(self, kind: str) -> str:
        self._counter += 1
        return f"chaos-{self.config.seed}-{self._counter}-{kind}"

    def _prompt(self, low: int, high: int) -> list[int]:
        top = min(30000, self.config.real_vocab or 30000)
        return [self.rng.randrange(5, top) for _ in range(self.rng.randint(low, high))]

    def _in_vocab(self, ids: list[int]) -> list[int]:
        """`ids` folded into the real engine's vocabulary (ids 0-4: its special tokens, left out)."""
        v = self.config.real_vocab
        return ids if not v else [(t - 5) % (v - 5) + 5 for t in ids]

    def _reference(self, prompt: list[int], max_tokens: int, **sampling: Any) -> list[list[int]] | None:
        """The simulated engine's tokens, or None: a real engine's come from its reference run."""
        return None if self.config.real_vocab else reference_tokens(prompt, max_tokens, **sampling)

    async def one(self, kind: str) -> None:
        self.in_flight += 1
        try:
            if kind.startswith("http"):
                await self._http_request(kind)
            else:
                await self._grpc_request(kind)
        finally:
            self.in_flight -= 1

    # ---- gRPC through kvmesh.client -------------------------------------------------------------------------
    def _grpc_body(self, kind: str) -> tuple[list[int], common_pb2.SamplingParams, str, list[list[int]] | None]:
        c = self.config
        seed = self.rng.randrange(1 << 31)
        if kind == "session":
            s = self.rng.randrange(c.sessions)
            self._turns[s] += 1
            prompt = self._in_vocab(session_prompt(s, self._turns[s], c.context_tokens))
            answer = 2 * c.max_tokens  # longer answers: more of them are mid-stream when a worker fails
            sampling = common_pb2.SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
            if c.seeded_sessions:
                sampling.seed = seed
            expected = self._reference(prompt, answer, seed=seed if c.seeded_sessions else None)
            return prompt, sampling, f"chaos-s{s}", expected
        prompt = self._prompt(16, 64) if kind == "short" else self._prompt(1500, 3000) if kind == "long" else []
        if kind == "n2":
            prompt = self._prompt(64, 256)
            sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.8, seed=seed, n=2, ignore_eos=True)
            return prompt, sampling, "", reference_tokens(prompt, 12, n=2, temperature=0.8, seed=seed)
        sampling = common_pb2.SamplingParams(max_tokens=c.max_tokens, temperature=0.0, seed=seed, ignore_eos=True)
        return prompt, sampling, "", self._reference(prompt, c.max_tokens, seed=seed)

    async def _grpc_request(self, kind: str) -> None:
        prompt, sampling, session, expected = self._grpc_body(kind)
        r = RequestRecord(self._rid(kind), "grpc", kind, self.now(), self.config.deadline_s, n=sampling.n or 1)
        r.prompt_tokens, r.expected = len(prompt), expected
        r.prompt, r.max_tokens = prompt, sampling.max_tokens
        self.records.append(r)
        k = await self._idle.get()
        self._current[k] = r
        client = self._clients[k]
        try:
            for send in range(2):
                left = r.started + r.deadline_s - self.now()
                if left <= 0:
                    break
                client.timeout_s = left
                req = router_pb2.RouterServiceGenerateRequest(
                    request_id=r.rid if send == 0 else f"{r.rid}-again",
                    token_ids=common_pb2.TokenIds(ids=prompt),
                    sampling=sampling,
                    session_id=session,
                )
                got: list[list[int]] = [[] for _ in range(r.n)]
                try:
                    async with asyncio.timeout(left + HANG_SLACK_S):
                        async for m in client.generate(req):
                            if m.index >= r.n:
                                r.note(self.now(), f"message for sequence {m.index} of a {r.n}-sequence request")
                                continue
                            got[m.index].extend(m.token_ids)
                            if m.migrations > r.migrations:
                                r.migrations = m.migrations
                                r.note(self.now(), f"the router migrated it ({m.migrations}), now on {m.worker_id}")
                            if m.token_ids:
                                r.note(self.now(), f"seq {m.index} +{len(m.token_ids)} = {len(got[m.index])}")
                except TimeoutError:
                    r.outcome, r.error_code, r.received = "hung", "DEADLINE_EXCEEDED", got
                    r.note(self.now(), "still open past its deadline")
                    return
                except (grpc.aio.AioRpcError, KvmeshError) as e:
                    r.error_code = _code(e)
                    r.note(self.now(), f"failed {r.error_code}: {str(e)[:200]}")
                    r.received = got
                    if send == 0 and retryable(r.error_code):
                        r.resent = True
                        continue
                    r.outcome = "failed"
                    return
                r.outcome, r.received, r.error_code = "ok", got, ""
                return
            r.outcome = r.outcome if r.outcome != "open" else "failed"
        finally:
            r.ended = self.now()
            self._current.pop(k, None)
            self._idle.put_nowait(k)

    # ---- the router's OpenAI HTTP API ---------------------------------------------------------------------
    async def _http_request(self, kind: str) -> None:
        assert self._http is not None
        c = self.config
        seed = self.rng.randrange(1 << 31)
        prompt = self._prompt(32, 512)
        stream = kind == "http_stream"
        body = {"prompt": prompt, "max_tokens": c.max_tokens, "temperature": 0, "seed": seed, "ignore_eos": True}
        body["stream"] = stream
        r = RequestRecord(self._rid(kind), "http", kind, self.now(), c.deadline_s)
        r.prompt_tokens, r.prompt, r.max_tokens = len(prompt), prompt, c.max_tokens
        ref = self._reference(prompt, c.max_tokens, seed=seed)
        r.expected = None if ref is None else [self.tokenizer.decode(t) for t in ref]
        self.records.append(r)
        zone = self.rng.choice("ab")
        try:
            for _attempt in range(12):
                left = r.started + r.deadline_s - self.now()
                if left <= 0:
                    r.outcome, r.error_code = "failed", "DEADLINE_EXCEEDED"
                    return
                r.attempts += 1
                url = self.suite.router_http(zone) + "/v1/completions"
                r.note(self.now(), f"attempt {r.attempts} via {url}")
                try:
                    async with asyncio.timeout(left + HANG_SLACK_S):
                        status, text, detail = await self._post(url, body, stream, left)
                except TimeoutError:
                    r.outcome, r.error_code = "hung", "DEADLINE_EXCEEDED"
                    r.note(self.now(), "still open past its deadline")
                    return
                except (aiohttp.ClientError, ConnectionError, ValueError) as e:
                    status, text, detail = 503, None, f"{type(e).__name__}: {e}"
                if status == 200 and text is not None:
                    r.outcome, r.received, r.error_code = "ok", [text], ""
                    return
                r.error_code = (
                    "RESOURCE_EXHAUSTED" if status == 429 else "UNAVAILABLE" if status >= 500 else f"HTTP_{status}"
                )
                r.note(self.now(), f"failed {status} {r.error_code}: {detail[:200]}")
                if not retryable(r.error_code):
                    r.outcome = "failed"
                    return
                zone = "b" if zone == "a" else "a"
                await asyncio.sleep(0.2)  # pacing between attempts, bounded by the deadline above
            r.outcome = "failed"
        finally:
            r.ended = self.now()

    async def _post(self, url: str, body: dict[str, Any], stream: bool, left: float) -> tuple[int, str | None, str]:
        """(status, the completion's text or None, what went wrong); an SSE stream's deltas joined."""
        assert self._http is not None
        timeout = aiohttp.ClientTimeout(total=left)
        async with self._http.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                return resp.status, None, (await resp.text())[:300]
            if not stream:
                data = await resp.json()
                return 200, data["choices"][0]["text"], ""
            parts: list[str] = []
            done = False
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return 503, None, json.dumps(event)[:300]
                parts.extend(ch.get("text", "") for ch in event.get("choices", []))
            if not done:
                return 503, None, f"stream ended without [DONE] after {len(''.join(parts))} characters"
            return 200, "".join(parts), ""

    # ---- the pool_full fault ---------------------------------------------------------------------------------
    async def fill(self, target: str, until: float, stop: asyncio.Event | None = None) -> int:
        """Long sessions straight to `target`'s Generate until `until` (or `stop` is set); returns how many were
        sent."""
        address = self.suite.address(target)
        sent = 0
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)

            async def one() -> None:
                seed = self.rng.randrange(1 << 31)
                prompt = self._prompt(FILL_PROMPT_TOKENS, FILL_PROMPT_TOKENS)
                r = RequestRecord(self._rid("fill"), "grpc", "fill", self.now(), self.config.deadline_s)
                r.prompt_tokens, r.expected = len(prompt), self._reference(prompt, 48, seed=seed)
                r.prompt, r.max_tokens = prompt, 48
                self.records.append(r)
                req = worker_pb2.GenerateRequest(
                    request_id=r.rid,
                    token_ids=common_pb2.TokenIds(ids=prompt),
                    sampling=common_pb2.SamplingParams(max_tokens=48, temperature=0.0, seed=seed, ignore_eos=True),
                )
                got: list[int] = []
                r.attempts = 1
                r.note(self.now(), f"sent to {target} ({address})")
                try:
                    async for m in stub.Generate(req, timeout=r.deadline_s):
                        got.extend(m.token_ids)
                    r.outcome = "ok"
                except grpc.aio.AioRpcError as e:
                    r.outcome, r.error_code = "failed", e.code().name
                    r.note(self.now(), f"failed {r.error_code}: {e.details()}")
                r.received, r.ended = [got], self.now()

            pending: set[asyncio.Task[None]] = set()

            def going() -> bool:
                return self.now() < until and not (stop is not None and stop.is_set())

            while going():
                while len(pending) < FILL_IN_FLIGHT and going():
                    pending.add(asyncio.create_task(one()))
                    sent += 1
                _done, pending = await asyncio.wait(pending, timeout=max(0.0, until - self.now()))
            if pending:
                await asyncio.wait(pending)
        return sent
