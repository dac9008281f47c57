"""`kvmesh.wire.proto`: every proto <-> domain conversion, paired ones round-tripped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.generation import (
    EngineOutput,
    PositionLogprobs,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    Usage,
)
from kvmesh.core.kvevents import BlockStored, KvEvent, KvEventBatch, LoadReport
from kvmesh.index.types import Cleared, Removed, Stored
from kvmesh.v1 import common_pb2, worker_pb2
from kvmesh.wire.proto import (
    batch_from_proto,
    batch_to_proto,
    delta_to_proto,
    dump_messages,
    event_from_proto,
    event_to_proto,
    load_from_proto,
    load_to_proto,
    logprobs_from_proto,
    output_to_proto,
    request_from_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from tests.support.kv_strategies import kv_batch, kv_event

pytestmark = pytest.mark.unit
f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
i32 = st.integers(0, (1 << 31) - 1)


@settings(max_examples=80, deadline=None)
@given(kv_event())
def test_event_round_trips(e: KvEvent) -> None:
    assert event_from_proto(event_to_proto(e)) == e


@settings(max_examples=40, deadline=None)
@given(kv_batch())
def test_batch_round_trips(b: KvEventBatch) -> None:
    assert batch_from_proto(batch_to_proto(b)) == b


def test_batch_takes_missing_ids_from_the_stream_hello() -> None:
    msg = common_pb2.KvEventBatch(sequence=3, timestamp=1.0)
    assert batch_from_proto(msg, "w", "i") == KvEventBatch("w", "i", 3, 1.0, ())
    assert event_from_proto(common_pb2.KvEvent()) is None


@settings(max_examples=40, deadline=None)
@given(
    st.builds(
        LoadReport,
        st.text(max_size=8),
        i32,
        i32,
        i32,
        f32,
        i32,
        i32,
        i32,
        i32,
        f32,
        f32,
        f32,
        f32,
        i32,
        st.floats(allow_nan=False, allow_infinity=False),
    )
)
def test_load_report_round_trips(r: LoadReport) -> None:
    assert load_from_proto(load_to_proto(r)) == r


def test_index_deltas_encode_every_kind() -> None:
    s = delta_to_proto(Stored("w", 9, (1, 2)))
    assert (s.worker_id, s.HasField("parent"), s.parent, list(s.stored)) == ("w", True, 9, [1, 2])
    assert not delta_to_proto(Stored("w", None, (1,))).HasField("parent")
    assert list(delta_to_proto(Removed("w", (3,))).removed) == [3]
    assert delta_to_proto(Cleared("w")).cleared


def test_request_decodes_prompt_sampling_and_unset_zero_values() -> None:
    r = worker_pb2.GenerateRequest(request_id="r", tenant="t", lora_name="")
    r.token_ids.ids.extend([1, 2])
    r.sampling.max_tokens = 0
    r.sampling.seed = 0
    req = request_from_proto(r)
    assert (req.prompt_token_ids, req.prompt, req.tenant, req.lora_name) == ((1, 2), None, "t", None)
    assert (req.sampling.max_tokens, req.sampling.top_p, req.sampling.seed) == (None, 1.0, 0)
    text = request_from_proto(worker_pb2.GenerateRequest(request_id="r", text="hi"))
    assert (text.prompt, text.prompt_token_ids, text.sampling.seed) == ("hi", None, None)


f16 = st.floats(-2, 2, width=16)  # exact in float32, the wire's width


@given(
    st.builds(
        SamplingParams,
        max_tokens=st.none() | st.integers(1, 8192),
        min_tokens=st.integers(0, 16),
        temperature=st.floats(0, 2, width=16),
        top_p=st.floats(0.125, 1, width=16),
        top_k=st.integers(-1, 100),
        seed=st.none() | st.integers(0, 2**63 - 1),
        stop=st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple),
        stop_token_ids=st.lists(st.integers(0, 1 << 20), max_size=3).map(tuple),
        ignore_eos=st.booleans(),
        presence_penalty=f16,
        frequency_penalty=f16,
        repetition_penalty=st.floats(0.125, 2, width=16),
    )
)
def test_sampling_round_trips_every_field_penalties_included(sp: SamplingParams) -> None:
    """Every sampling field crosses the router -> worker hop (a field left off would be silently ignored)."""
    assert sampling_from_proto(sampling_to_proto(sp)) == sp


def test_output_carries_usage_and_finish_on_the_last_message() -> None:
    mid = output_to_proto(EngineOutput("r", (1,), "a", False, None, None), "w", detokenize=False)
    assert (list(mid.token_ids), mid.text, mid.finish_reason) == ([1], "", common_pb2.FINISH_REASON_UNSPECIFIED)
    last = output_to_proto(EngineOutput("r", (2,), "b", True, "prefill_only", Usage(5, 2, 1)), "w", detokenize=True)
    assert (last.text, last.finish_reason, last.usage.cached_tokens) == ("b", common_pb2.FINISH_REASON_LENGTH, 2)


def test_a_dump_is_begin_chunks_end_all_at_one_sequence() -> None:
    blocks = [BlockStored((i,), None, (i,), 1) for i in range(5)]
    msgs = list(dump_messages("w", "i", 7, blocks, 1.0, chunk=2))
    kinds = [k for k, _ in msgs]
    assert kinds == [common_pb2.KV_STREAM_KIND_DUMP_BEGIN] + [common_pb2.KV_STREAM_KIND_DUMP_CHUNK] * 2 + [
        common_pb2.KV_STREAM_KIND_DUMP_END
    ]
    assert {m.sequence for _, m in msgs} == {7}
    assert [e for _, m in msgs for e in batch_from_proto(m).events] == blocks


def test_every_sampling_extension_survives_the_wire() -> None:
    sp = SamplingParams(
        n=3,
        logprobs=0,
        prompt_logprobs=2,
        min_p=0.25,
        logit_bias=((2, -1.5), (7, 3.0)),
        bad_words=("x y",),
        allowed_token_ids=(4, 5),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        structured_output=StructuredOutput(choice=("yes", "no")),
        priority=-2,
    )
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    for constraint in (
        StructuredOutput(json_schema='{"type": "object"}'),
        StructuredOutput(json_object=True),
        StructuredOutput(regex="[a-z]+"),
        StructuredOutput(grammar='root ::= "a"'),
    ):
        with_it = SamplingParams(structured_output=constraint)
        assert sampling_from_proto(sampling_to_proto(with_it)) == with_it


def test_unset_extensions_decode_to_their_defaults() -> None:
    # logprobs 0 (the sampled token's only) differs from unset (none), and unset skip_special_tokens is True
    decoded = sampling_from_proto(common_pb2.SamplingParams())
    assert (decoded.n, decoded.logprobs, decoded.prompt_logprobs, decoded.structured_output) == (1, None, None, None)
    assert decoded.skip_special_tokens is True
    assert sampling_from_proto(common_pb2.SamplingParams(logprobs=0)).logprobs == 0


def test_output_logprobs_and_index_travel() -> None:
    # log-probabilities exact in float32, as the wire carries them
    top = (TokenLogprob(9, -0.125, 1), TokenLogprob(3, -2.5, 2))
    lp = (PositionLogprobs(TokenLogprob(3, -2.5, 2), top),)
    out = EngineOutput("r", token_ids=(3,), index=2, logprobs=lp, prompt_logprobs=(None, lp[0]))
    msg = output_to_proto(out, "w0", detokenize=False)
    assert msg.index == 2
    assert logprobs_from_proto(msg.logprobs) == lp
    assert logprobs_from_proto(msg.prompt_logprobs) == (None, lp[0])
