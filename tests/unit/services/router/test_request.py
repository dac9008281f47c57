"""`RouterRequest.checked`, the one check a request gets inside the router: each limit refused naming its field
(the first that fails, in the documented order), a client's out-of-range ids refused before they become
uint32, and no RouterRequest built any other way."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import EngineRequest, SamplingParams, StructuredOutput
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.wire.token_ids import TokenIdArray

pytestmark = pytest.mark.unit

LIMITS = CoreLimits(max_prompt_tokens=8, default_max_tokens=4, max_tokens_limit=6, vocab_size=100)


def checked(prompt: object = (1, 2, 3), max_tokens: int | None = None, **kw: object) -> RouterRequest:
    stop = kw.pop("stop", ())
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop)  # type: ignore[arg-type]
    return RouterRequest.checked(LIMITS, "r", prompt, sampling, **kw)  # type: ignore[arg-type]


REFUSED = {
    "empty": ({"prompt": ()}, "prompt", "must not be empty"),
    "long": ({"prompt": tuple(range(9))}, "prompt", "9 tokens > limit 8"),
    "max-tokens": ({"max_tokens": 7}, "max_tokens", "7 > limit 6"),
    "resumed-over-default": ({"resume_ids": [1] * 5}, "resume_token_ids", "5 tokens > max_tokens 4"),
    "id-beyond-uint32": ({"prompt": (5, 2**40)}, "prompt", "prompt[1] is 1099511627776"),
    "id-beyond-vocab": ({"prompt": TokenIdArray.of([5, 100])}, "prompt", "prompt[1] is 100"),
    "stop-id": ({"stop": (3, 2**40)}, "stop_token_ids", "stop_token_ids[1]"),
    "resumed-id": ({"resume_ids": [100]}, "resume_token_ids", "resume_token_ids[0] is 100"),
    "length-before-vocab": ({"prompt": (100,) * 9}, "prompt", "9 tokens > limit 8"),
}


@pytest.mark.parametrize(("kw", "field", "message"), list(REFUSED.values()), ids=list(REFUSED))
def test_each_limit_is_refused_naming_its_field(kw: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        checked(**kw)
    assert ei.value.field == field and message in ei.value.message


def test_a_checked_request_keeps_the_prompt_it_was_given_and_the_effective_budget() -> None:
    prompt = TokenIdArray.of([1, 2, 3])
    req = checked(prompt, resume_ids=[7, 8], tenant="acme", lora="lo")
    assert req.prompt is prompt and req.max_tokens == LIMITS.default_max_tokens  # none asked: the default
    assert (req.resume_ids, req.tenant, req.lora) == ((7, 8), "acme", "lo")
    listed = checked([1, 2, 3], max_tokens=6)
    assert listed.prompt.wire == prompt.wire and listed.prompt.array.tolist() == [1, 2, 3] and listed.max_tokens == 6
    assert RouterRequest.checked(
        LIMITS, "", [1], SamplingParams(max_tokens=None)
    ).request_id  # one is made up when absent


def test_no_request_is_built_unchecked() -> None:
    with pytest.raises(TypeError, match=r"RouterRequest\.checked"):
        RouterRequest("r", TokenIdArray.of([1]), SamplingParams(), 4, "", "", (), "")


def test_a_structured_output_resumes_like_any_request() -> None:
    grammar = SamplingParams(max_tokens=4, structured_output=StructuredOutput(json_object=True))
    assert RouterRequest.checked(LIMITS, "r", (1, 2), grammar, resume_ids=[3]).resume_ids == (3,)
    with pytest.raises(InvalidArgument) as ei:  # the bound on resumed tokens holds all the same
        RouterRequest.checked(LIMITS, "r", (1, 2), grammar, resume_ids=[3] * 5)
    assert ei.value.field == "resume_token_ids"


def test_a_resumed_sequence_of_a_seeded_n_request_continues_that_sequence() -> None:
    # the engine samples sequence i of a seeded n > 1 request from seed + i (as vLLM does): the router resumes
    # sequence i, as a request of its own, under that seed, so it continues sequence i and not sequence 0
    def tokens(request: EngineRequest) -> dict[int, list[int]]:
        core = SimEngineCore(SimConfig(block_size=16, num_blocks=256))
        core.add_request(request, 0.0)
        out: dict[int, list[int]] = {}
        now = 0.0
        while core.has_work():
            step = core.step(now)
            now += step.duration_s
            for o in step.outputs:
                out.setdefault(o.index, []).extend(o.token_ids)
        return out

    prompt = tuple(range(10, 90))
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2)
    both = tokens(EngineRequest("r", prompt, sampling=sampling))
    assert both[0] != both[1]
    limits = CoreLimits(max_prompt_tokens=100, vocab_size=128_256)
    parent = RouterRequest.checked(limits, "r", prompt, sampling)
    second = parent.sequence(1, both[1][:2])
    assert second.sampling.n == 1 and second.sampling.seed == 6
    resumed = EngineRequest(
        second.request_id,
        prompt + tuple(second.resume_ids),
        sampling=dataclasses.replace(second.sampling, max_tokens=4),
        resumed_output_tokens=2,
    )
    assert tokens(resumed)[0] == both[1][2:]
    greedy = RouterRequest.checked(limits, "g", prompt, dataclasses.replace(sampling, temperature=0.0))
    assert greedy.sequence(1, ()).sampling.seed == 5  # greedy: the seed samples nothing
