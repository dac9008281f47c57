"""`CutPromptText`: a prompt ending inside a UTF-8 character (a migration cut between its byte tokens) gets a
first text that starts where the client's text stopped, not vLLM's first text with the whole prompt in it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.engine.cut_prompt_text import CutPromptText

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


def test_lone_bytes_at_the_prompt_s_end_stay_the_prompt_s() -> None:
    fix = CutPromptText(decode, [ord("a"), 0xFF, 0xFE])  # bytes no character starts or continues with
    assert fix.cut
    assert fix.text(0, list(b" ok"), "a\ufffd\ufffd ok") == " ok"


@pytest.mark.parametrize("prompt", [list(b"whole words"), list("caf\u00e9".encode()), []])
def test_a_prompt_of_whole_characters_is_left_to_vllm(prompt: list[int]) -> None:
    fix = CutPromptText(decode, prompt)
    assert not fix.cut
    assert fix.text(0, [ord("x")], "anything vLLM says") == "anything vLLM says"
