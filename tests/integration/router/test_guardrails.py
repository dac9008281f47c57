"""Output guardrails end to end: a real router process (`--guardrails FILE`) in front of a real sim worker, over
gRPC and HTTP on 127.0.0.1.

The sim worker decodes with the tiny model's tokenizer, whose tokens are word pieces ("pas", "stering"), and
its tokens depend only on (seed, position): a reference run of a seeded request gives the exact text and its
chunking, and a word that spans two chunks is picked from it. Rule edits are synchronised on the router's
`kvmesh_router_guardrail_reloads_total` counter; the mid-stream edit freezes the worker with SIGSTOP (nothing
more is generated) while the file changes and the router reloads, and checks with the router's own message
counters that the word had not reached the router before the edit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.models import tiny_model
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
BOUND_S = 20.0
PROMPT = [(7 * i) % 1000 + 3 for i in range(40)]  # below the tiny model's 1024 ids
MAX_TOKENS = 48
MASK = "***"


@dataclass
class Suite:
    worker: ServiceProcess
    router: ServiceProcess
    rules: Path


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    tmp = tmp_path_factory.mktemp("guardrails")
    rules = tmp / "guardrails.yaml"
    rules.write_text("rules: []\n")
    worker = start_service(
        "worker",
        tmp / "w",
        *("--engine", "sim", "--model", tiny_model(), "--block-size", "16", "--kv-blocks", "1024"),
        *("--sim-speed", "1"),  # ~19 ms a token: the mid-stream edit has a margin of many tokens
    )
    router = start_service(
        "router",
        tmp / "r",
        *("--workers", worker.address, "--block-size", "16", "--stall-detection", "false"),
        *("--guardrails", str(rules), "--guardrails-reload-s", "0.05"),
    )
    try:
        yield Suite(worker, router, rules)
    finally:
        assert router.terminate(timeout=30) == 0
        assert worker.terminate(timeout=30) == 0


def request(seed: int, tenant: str = "") -> router_pb2.RouterServiceGenerateRequest:
    sp = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed)
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=sp, tenant=tenant
    )


def stream(
    s: Suite, req: router_pb2.RouterServiceGenerateRequest
) -> Iterator[router_pb2.RouterServiceGenerateResponse]:
    with grpc.insecure_channel(s.router.address) as ch:
        yield from router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=BOUND_S)


def wait_for(cond: Callable[[], bool], what: str) -> None:
    """Polls `cond` until true, at most BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def set_rules(s: Suite, yaml_text: str) -> None:
    """Rewrites the rule file and waits until the router has reloaded it."""
    before = metric(s.router.http_port, "kvmesh_router_guardrail_reloads_total", 'outcome="ok"')
    s.rules.write_text(yaml_text)
    wait_for(
        lambda: metric(s.router.http_port, "kvmesh_router_guardrail_reloads_total", 'outcome="ok"') > before,
        "the router to reload its guardrails",
    )


def words_rule(word: str, action: str, tenants: str = "") -> str:
    extra = f", tenants: [{tenants}]" if tenants else ""
    return f"rules:\n  - {{name: w, words: [{json.dumps(word)}], action: {action}{extra}}}\n"


@dataclass
class Reference:
    """An unfiltered run: chunk texts, token ids, usage; `word`: a whole word spanning two chunks, starting in
    chunk `chunk` at character `start`."""

    texts: list[str]
    ids: list[int]
    usage: common_pb2.Usage
    word: str
    chunk: int
    start: int

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def masked(self) -> str:
        return re.sub(rf"(?<!\w){re.escape(self.word)}(?!\w)", MASK, self.text, flags=re.IGNORECASE)

    def first(self) -> int:
        m = re.search(rf"(?<!\w){re.escape(self.word)}(?!\w)", self.text, flags=re.IGNORECASE)
        assert m is not None
        return m.start()


def reference(s: Suite, seed: int, last: bool = False) -> Reference:
    """The unfiltered run of `seed` (the rule file empty) and a word in it spanning a chunk boundary (the
    first, or the `last` one)."""
    set_rules(s, f"rules: []  # reference run, seed {seed}, {time.monotonic_ns()}\n")  # new content: a reload
    msgs = list(stream(s, request(seed)))
    texts = [m.text for m in msgs]
    ends = [sum(len(t) for t in texts[: i + 1]) for i in range(len(texts))]
    full = "".join(texts)
    ids = [t for x in msgs for t in x.token_ids]
    found = []
    for m in re.finditer(r"(?<!\w)\w{4,}(?!\w)", full):
        inside = [e for e in ends if m.start() < e < m.end()]
        first_at = re.search(rf"(?<!\w){re.escape(m.group())}(?!\w)", full, flags=re.IGNORECASE)
        if inside and first_at is not None and first_at.start() == m.start():  # its first occurrence is split
            chunk = next(i for i, e in enumerate(ends) if e > m.start())
            found.append(Reference(texts, ids, msgs[-1].usage, m.group(), chunk, m.start()))
    assert found, f"seed {seed}: no word spans two chunks in {texts!r}"
    return found[-1] if last else found[0]


def test_a_word_split_across_chunks_is_masked_then_stops_with_content_filter(suite: Suite) -> None:
    ref = reference(suite, seed=11)
    assert ref.masked() != ref.text
    set_rules(suite, words_rule(ref.word, "mask"))
    msgs = list(stream(suite, request(11)))
    got = "".join(m.text for m in msgs)
    assert got == ref.masked()
    assert not any(re.search(re.escape(ref.word), m.text, re.IGNORECASE) for m in msgs)
    assert [t for m in msgs for t in m.token_ids] == ref.ids  # the engine's tokens, all of them
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == ref.usage.completion_tokens == MAX_TOKENS
    hits = metric(suite.router.http_port, "kvmesh_router_guardrail_matches_total", 'rule="w"')
    assert hits >= ref.masked().count(MASK)

    set_rules(suite, words_rule(ref.word.upper(), "stop"))
    msgs = list(stream(suite, request(11)))
    assert "".join(m.text for m in msgs) == ref.text[: ref.first()]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_CONTENT_FILTER
    assert 0 < msgs[-1].usage.completion_tokens <= MAX_TOKENS and msgs[-1].usage.prompt_tokens == len(PROMPT)
    sent = [t for m in msgs for t in m.token_ids]
    assert sent == ref.ids[: len(sent)] and len(sent) <= ref.chunk  # the word's tokens are not sent


def test_http_stream_and_whole_response_end_with_content_filter(suite: Suite) -> None:
    ref = reference(suite, seed=23)
    set_rules(suite, words_rule(ref.word, "stop"))
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 23}
    with httpx.Client(base_url=f"http://127.0.0.1:{suite.router.http_port}", timeout=BOUND_S) as c:
        whole = c.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        assert choice["finish_reason"] == "content_filter" and choice["text"] == ref.text[: ref.first()]
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref.text[: ref.first()]


def test_http_chat_stream_ends_with_content_filter(suite: Suite) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    body |= {"seed": 5, "stream": True}
    set_rules(suite, f"rules: []  # {time.monotonic_ns()}\n")
    full = "".join(d.get("content", "") for d in _chat_deltas(suite, body)[0])
    word = next(m.group() for m in re.finditer(r"(?<!\w)\w{4,}(?!\w)", full))
    set_rules(suite, words_rule(word, "stop"))
    deltas, finish = _chat_deltas(suite, body)
    assert deltas[0]["role"] == "assistant"
    assert finish == "content_filter"
    assert "".join(d.get("content", "") for d in deltas) == full[: full.index(word)]


def _chat_deltas(s: Suite, body: dict[str, object]) -> tuple[list[dict[str, str]], str | None]:
    """The deltas of a streamed chat completion and its finish reason."""
    base = f"http://127.0.0.1:{s.router.http_port}"
    with httpx.Client(base_url=base, timeout=BOUND_S) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    return [ch["delta"] for ch in choices], choices[-1]["finish_reason"]


def test_rules_per_tenant(suite: Suite) -> None:
    ref = reference(suite, seed=11)
    set_rules(suite, words_rule(ref.word, "mask", tenants="alice"))
    assert "".join(m.text for m in stream(suite, request(11, tenant="alice"))) == ref.masked()
    assert "".join(m.text for m in stream(suite, request(11, tenant="bob"))) == ref.text


def test_a_rule_file_edited_while_a_stream_runs_applies_from_its_next_chunk(suite: Suite) -> None:
    ref = reference(suite, seed=37, last=True)
    set_rules(suite, words_rule("nonexistentword", "mask"))
    port = suite.router.http_port
    steps_before = _router_steps(port)
    it = stream(suite, request(37))
    first = next(it)  # the stream runs, under the old list
    os.kill(suite.worker.proc.pid, signal.SIGSTOP)  # no more tokens until SIGCONT
    try:
        received = _router_steps(port) - steps_before
        assert received <= ref.chunk, f"the router had {received} steps, the word starts in step {ref.chunk}"
        set_rules(suite, words_rule(ref.word, "mask"))
    finally:
        os.kill(suite.worker.proc.pid, signal.SIGCONT)
    rest = list(it)
    got = first.text + "".join(m.text for m in rest)
    assert got == ref.masked()
    assert ref.text[: ref.start].startswith(first.text)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_bad_edit_keeps_the_rules_in_force(suite: Suite) -> None:
    ref = reference(suite, seed=11)
    set_rules(suite, words_rule(ref.word, "mask"))
    port = suite.router.http_port
    errors = metric(port, "kvmesh_router_guardrail_reloads_total", 'outcome="error"')
    suite.rules.write_text("rules:\n  - {name: w, pattern: '(', action: mask}\n")
    wait_for(lambda: metric(port, "kvmesh_router_guardrail_reloads_total", 'outcome="error"') > errors, "the error")
    assert "".join(m.text for m in stream(suite, request(11))) == ref.masked()
    assert metric(port, "kvmesh_router_guardrail_rules") == 1
    assert suite.router.proc.poll() is None


def test_a_bad_rule_file_fails_the_start_naming_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {name: ok, words: [a], action: mask}\n  - {name: oops, words: [b], action: nuke}\n")
    with pytest.raises(RuntimeError, match="router exited with 2") as e:
        start_service("router", tmp_path / "r", "--workers", "127.0.0.1:1", "--guardrails", str(bad), timeout=30)
    assert f"guardrails: {bad}:3: rule 'oops': `action` must be mask or stop" in str(e.value)


def _router_steps(port: int) -> float:
    """Streamed steps with tokens the router has received from workers (first ones and later ones)."""
    return metric(port, "kvmesh_router_ttft_seconds_count") + metric(port, "kvmesh_router_itl_seconds_count")
