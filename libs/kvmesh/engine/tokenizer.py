"""Tokenizers for engines that do not bring their own: bytes (default for the sim) or a tokenizer.json."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes: id = byte + 3 (0..2 reserved: pad, bos, eos). Ids above 258 decode to ' w<id>'."""

    OFFSET = 3
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        out: list[str] = []
        raw = bytearray()
        for t in token_ids:
            if self.OFFSET <= t < 256 + self.OFFSET:
                raw.append(t - self.OFFSET)
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw.clear()
            if t >= 256 + self.OFFSET:
                out.append(f" w{t}")
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)


class HfTokenizer:
    """A Hugging Face `tokenizer.json` (e.g. the tiny local model's), loaded with `tokenizers`."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        self._tok = _Tok.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        self.backend = self._tok  # the `tokenizers.Tokenizer` itself (e.g. for its DecodeStream)
        self.vocab_size = int(self._tok.get_vocab_size())
        # characters one token can stand for, at most (byte-level and sentencepiece entries have at least
        # one character per character of text they match; byte-fallback entries like <0x0A> more)
        self.longest_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers < 0.21

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, through `encode_batch_fast`: it computes no character offsets (nothing here
        uses them; 1.3-2x faster than `encode` on the tiny model's prompts) and releases the GIL while it
        works (`encode` holds it), so concurrent long prompts tokenise in parallel on several cores."""
        return list(self._encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))
