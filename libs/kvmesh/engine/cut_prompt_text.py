"""The first text of a sequence whose prompt ends inside a character.

A prompt can end with part of a multi-byte UTF-8 character: a resumed request's prompt ends with the output
so far, which a migration can cut between the byte tokens of one character (the client then holds the text
up to the character before), and a client may send token ids so. vLLM's incremental detokenizer, primed with
the prompt, then cannot tell where the prompt's text ends: the step that completes the character returns the
whole prompt's text with it. `CutPromptText` recomputes that one text from token ids: the prompt's last
tokens and the sequence's first ones decoded together, from where that text stops agreeing with the tail's
own (an unfinished character decodes as U+FFFD until its last byte comes; a lone byte stays U+FFFD, the
prompt's, not the output's), and up to where vLLM's own text stops: a first delta of several tokens whose
last ones begin an unfinished character leaves that character to vLLM's next delta. vLLM's later deltas are
right again, as its detokenizer is past the cut by then.
Pure: `decode` is the model's tokenizer.

A resumed request's prompt ends with output of its own (`ResumedText`): there the text is rebuilt from the
prompt before it (`SentText`: tokenizers' `DecodeStream` as vLLM drives it, `StreamText`, with the correction
above), so the client's text is the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
        tokens = self._tail + self._pending.pop(index)
        # vLLM's text covers the tokens up to the last one after which the text ends on a whole character: an
        # unfinished character at the end (one token of a multi-token delta) is held back and comes with its
        # next delta, so it must not be sent here too
        end = next(
            (n for n in range(len(tokens), len(self._tail), -1) if not self._decode(tokens[:n]).endswith(REPLACEMENT)),
            len(tokens),
        )
        after = self._decode(tokens[:end])
        return after[_common_prefix(self._tail_text, after) :]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error that vLLM recovers from by a reset


class StreamText:
    """tokenizers' `DecodeStream` as vLLM's incremental detokenizer drives it: primed with `context`, special
    tokens skipped or not, started afresh where tokenizers reports an invalid prefix (vLLM's recovery).
    `tokenizer` is a `tokenizers.Tokenizer`."""

    __slots__ = ("_skip", "_stream", "_tok")

    def __init__(self, tokenizer: Any, context: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._stream = self._new(context)

    def _new(self, context: Sequence[int] | None) -> Any:
        from tokenizers.decoders import DecodeStream  # tokenizers only where a real tokenizer is used

        ids = list(context) if context is not None else None
        return DecodeStream(ids=ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """The text `token_id` adds ("" while a character is unfinished)."""
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception as e:  # tokenizers raises a bare Exception; vLLM recovers from this one so
            if not str(e).startswith(INVALID_PREFIX):
                raise
            self._stream = self._new(None)  # no context, as vLLM restarts it
            piece = self._stream.step(self._tok, token_id)
        return piece or ""


class SentText:
    """The text a vLLM worker sends for the tokens generated after `context`, one token at a time: vLLM's
    detokenizer (`StreamText`, primed with `context`) with the worker's `CutPromptText` correction where
    `context` ends inside a character. `tokenizer` is a `tokenizers.Tokenizer`."""

    __slots__ = ("_cut", "_stream")

    def __init__(self, tokenizer: Any, context: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._stream = StreamText(tokenizer, context, skip_special_tokens)
        self._cut = CutPromptText(lambda ids: str(tokenizer.decode(ids, skip_special_tokens)), context)

    def step(self, token_id: int) -> str:
        """The text `token_id` adds ("" while a character is unfinished)."""
        return self._cut.text(0, [token_id], self._stream.step(token_id))


class ResumedText:
    """The texts of a resumed request, whose prompt ends with `resumed` tokens of its own output (sent before a
    migration). vLLM's detokenizer, primed with the whole prompt, takes those for prompt: a character split
    across the migration, held back by the first attempt while unfinished (U+FFFD if it never finishes), was
    lost from the client's text or came twice. Here each sequence's text comes from a `SentText` of the prompt
    before those tokens (so corrected as the first attempt's was, where that prompt ends inside a character),
    stepped through them unsent, so it continues exactly the text an uninterrupted run sends; vLLM's own
    text is not used."""

    __slots__ = ("_context", "_resumed", "_skip", "_streams", "_tok", "cut")

    def __init__(self, tokenizer: Any, prompt: Sequence[int], resumed: int, skip_special_tokens: bool = True) -> None:
        if not 0 < resumed < len(prompt):
            raise ValueError(f"resumed: 1..{len(prompt) - 1} of the prompt's tokens, got {resumed}")
        self._tok, self._skip, self.cut = tokenizer, skip_special_tokens, True
        self._context, self._resumed = list(prompt[:-resumed]), list(prompt[-resumed:])
        self._streams: dict[int, SentText] = {}

    def text(self, index: int, token_ids: Sequence[int], vllm_text: str) -> str:
        """The text to send for sequence `index`'s new `token_ids` (`vllm_text` unused: see the class)."""
        sent = self._streams.get(index)
        if sent is None:
            sent = self._streams[index] = SentText(self._tok, self._context, self._skip)
            for t in self._resumed:
                sent.step(t)  # the first attempt sent these tokens' text, as far as it was finished
        return "".join(sent.step(t) for t in token_ids)
