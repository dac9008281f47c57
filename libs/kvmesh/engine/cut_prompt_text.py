"""The first text of a sequence whose prompt ends inside a character.

A prompt can end with part of a multi-byte UTF-8 character: a resumed request's prompt ends with the output
so far, which a migration can cut between the byte tokens of one character (the client then holds the text
up to the character before), and a client may send token ids so. vLLM's incremental detokenizer, primed with
the prompt, then cannot tell where the prompt's text ends: the step that completes the character returns the
whole prompt's text with it. `CutPromptText` recomputes that one text from token ids: the prompt's last
tokens and the sequence's first ones decoded together, from where that text stops agreeing with the tail's
own (an unfinished character decodes as U+FFFD until its last byte comes; a lone byte stays U+FFFD, the
prompt's, not the output's). vLLM's later deltas are right again, as its detokenizer is past the cut by then.
Pure: `decode` is the model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete character
TAIL = 4  # a UTF-8 character is at most 4 bytes, so the tokens of an unfinished one are among the last 4


class CutPromptText:
    """Corrects each sequence's first text when the prompt ends inside a character (see the module docstring);
    `cut` is False for every other prompt, and `text` then returns vLLM's text as it is."""

    __slots__ = ("_decode", "_done", "_pending", "_tail", "_tail_text", "cut")

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int]) -> None:
        self._decode = decode
        self._tail = list(prompt[-TAIL:])
        tail_text = decode(self._tail) if self._tail else ""
        self.cut = tail_text.endswith(REPLACEMENT)
        self._tail_text = tail_text
        self._pending: dict[int, list[int]] = {}  # sequence index -> its tokens until its first text
        self._done: set[int] = set()

    def text(self, index: int, token_ids: Sequence[int], vllm_text: str) -> str:
        """The text to send for sequence `index`'s new `token_ids`, for which vLLM gave `vllm_text`."""
        if not self.cut or index in self._done:
            return vllm_text
        pending = self._pending.setdefault(index, [])
        pending.extend(token_ids)
        if not vllm_text:  # the character is still unfinished: vLLM holds it back, as it should
            return vllm_text
        self._done.add(index)
        after = self._decode(self._tail + self._pending.pop(index))
        return after[_common_prefix(self._tail_text, after) :]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
