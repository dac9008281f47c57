"""`CutPromptText`: a prompt ending inside a UTF-8 character (a migration cut between its byte tokens) gets a
first text that starts where the client's text stopped, not vLLM's first text with the whole prompt in it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.cut_prompt_text import CutPromptText, ResumedText, StreamText
from kvmesh.engine.tokenizer import HfTokenizer

pytestmark = pytest.mark.unit


def decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer: token id = byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_the_first_text_completes_the_cut_character_without_the_prompt() -> None:
    prompt = list(b"prompt: ca") + list("fé".encode())[:-1]  # "…caf" + the first byte of "é"
    fix = CutPromptText(decode, prompt)
    assert fix.cut
    leaked = decode(prompt[:-1]) + "é!"  # what vLLM's first text was: the prompt's text and the new character
    assert fix.text(0, [0xA9, ord("!")], leaked) == "é!"
    assert fix.text(0, [ord("?")], "?") == "?"  # later deltas are vLLM's own


def test_a_character_still_unfinished_is_held_back_then_sent_whole() -> None:
    euro = list("€".encode())  # 3 bytes
    fix = CutPromptText(decode, [ord("x"), euro[0]])
    assert fix.text(0, [euro[1]], "") == ""  # vLLM has no text yet either
    assert fix.text(0, [euro[2]], "x€") == "€"


def test_each_sequence_is_corrected_once_on_its_own() -> None:
    fix = CutPromptText(decode, [ord("a"), 0xC3])
    assert fix.text(1, [0xA9], "aé") == "é"
    assert fix.text(0, [0xA8, ord("z")], "aèz") == "èz"
    assert fix.text(1, [ord("q")], "q") == "q"


def test_an_unfinished_character_at_the_end_of_a_first_delta_is_left_to_vllm_s_next_delta() -> None:
    """A first delta of several tokens whose last one begins a character: vLLM's text stops before it and
    its next delta carries it; the first text must stop there too, or the client gets a U+FFFD and then the
    character (found by the chaos campaign on vLLM workers: a lone byte token's U+FFFD sent twice)."""
    euro = list("€".encode())
    fix = CutPromptText(decode, [ord("a"), 0xC3])
    assert fix.text(0, [0xA9, euro[0]], "aé") == "é"  # vLLM holds back the € it has one byte of
    assert fix.text(0, euro[1:], "€") == "€"


def test_lone_bytes_at_the_prompt_s_end_stay_the_prompt_s() -> None:
    fix = CutPromptText(decode, [ord("a"), 0xFF, 0xFE])  # bytes no character starts or continues with
    assert fix.cut
    assert fix.text(0, list(b" ok"), "a\ufffd\ufffd ok") == " ok"


@pytest.mark.parametrize("prompt", [list(b"whole words"), list("caf\u00e9".encode()), []])
def test_a_prompt_of_whole_characters_is_left_to_vllm(prompt: list[int]) -> None:
    fix = CutPromptText(decode, prompt)
    assert not fix.cut
    assert fix.text(0, [ord("x")], "anything vLLM says") == "anything vLLM says"


FOUND_PROMPT = (
    767, 21, 120, 906, 130, 540, 216, 941, 55, 647, 988, 189, 915, 724, 843, 984, 13, 74, 589, 543, 642, 681,
    71, 929, 970, 807, 891, 914, 820, 814, 831, 788, 749, 660, 637, 238, 821, 381, 18, 82, 290, 534, 165, 186,
)  # fmt: skip
FOUND_TOKENS = (
    619, 149, 852, 251, 279, 193, 130, 575, 967, 831, 461, 933, 846, 165, 180, 142, 107, 1006, 930, 751, 935, 81,
    32, 1023,
)  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> HfTokenizer:
    model = resolve_model_dir("")
    if model is None:
        pytest.fail("the tiny model is missing: scripts/bootstrap.sh builds it")
    return HfTokenizer(model)


@pytest.mark.parametrize("first", range(1, 9))
def test_the_campaign_s_request_gets_one_text_however_vllm_groups_its_first_tokens(
    tok: HfTokenizer, first: int
) -> None:
    """The request the chaos campaign found, on the tiny model's tokenizer: its prompt ends with two lone byte
    tokens, its second output token is a lone byte. vLLM's text is `StreamText` (its detokenizer), its first
    delta `first` tokens, then one token each: the client's text is the same for every grouping."""

    def client_text(first: int) -> str:
        stream, fix = StreamText(tok.backend, FOUND_PROMPT), CutPromptText(tok.decode, FOUND_PROMPT)
        deltas = [FOUND_TOKENS[:first]] + [(t,) for t in FOUND_TOKENS[first:]]
        return "".join(fix.text(0, d, "".join(stream.step(t) for t in d)) for d in deltas)

    assert CutPromptText(tok.decode, FOUND_PROMPT).cut
    whole = client_text(1)
    assert whole.startswith("sour\ufffd assistant")
    assert client_text(first) == whole


def test_a_request_resumed_at_any_token_continues_the_text_when_its_first_prompt_ended_inside_a_character(
    tok: HfTokenizer,
) -> None:
    """A migration of a request whose own prompt ended inside a character: the first attempt's text came
    corrected by `CutPromptText`; the resumed attempt's must continue it, for a cut at every token, the cut
    character's own bytes included (the tiny model's byte-level tokens: "€" is 161 227 108, "é" 130 105)."""
    prompt = (*tok.encode("price: "), 161)  # ends with the first byte of "€"
    out = (227, 108, *tok.encode(" or "), 130, 105, *tok.encode(" and"), 161, 227)

    def sent(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> str:  # a first attempt, one token a delta
        stream, fix = StreamText(tok.backend, prompt), CutPromptText(tok.decode, prompt)
        return "".join(fix.text(0, [t], stream.step(t)) for t in tokens)

    whole = sent(prompt, out)
    assert whole == "€ or é and"  # the last "€" never finished: held back
    for k in range(1, len(out)):
        resumed = ResumedText(tok.backend, (*prompt, *out[:k]), k)
        assert sent(prompt, out[:k]) + resumed.text(0, out[k:], "vLLM's text, unused") == whole, k
