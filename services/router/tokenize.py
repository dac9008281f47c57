"""Tokenisation in the router (once per request): HF `tokenizers` from the served model's folder.

Model folder resolution: `--model`, else `$KVMESH_HOME/models/tiny-llama`, else
`~/.cache/kvmesh/models/tiny-llama` (built by `scripts/build_tiny_model.py`); with no folder at all the
router uses the simulated engine's byte tokenizer (`kvmesh.engine.tokenizer.ByteTokenizer`), which is what
sim workers without a model use. Chat messages are rendered with the folder's `chat_template`
(tokenizer_config.json, Jinja) when it has one, else as `<|role|>\\ncontent\\n` lines ending with
`<|assistant|>\\n`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.token_cache import TokenCache
from kvmesh.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

log = logging.getLogger(__name__)

CHARS_PER_TOKEN_CAP = 32  # assumed at most, whatever the vocabulary's longest entry (a few are long runs)


class RouterTokenizer:
    """encode / decode / render_chat for one model, and the cache of its tokenised texts."""

    def __init__(self, model: str = "", cache_mb: int = 0) -> None:
        if cache_mb < 0:
            raise InvalidArgument("tokenize_cache_mb", f"must be >= 0 MiB (0 = off), got {cache_mb}")
        self.cache = TokenCache(cache_mb * 2**20)
        self.model_dir = resolve_model_dir(model)
        self.tok: Tokenizer
        self._template: Any = None
        self.bos = ""
        self.eos = ""
        if self.model_dir is None:
            log.warning("no tokenizer.json found (model=%r): using the byte tokenizer", model)
            self.tok = ByteTokenizer()
            self.name = model or "sim"
            self.vocab_size = ByteTokenizer.vocab_size
            self.max_chars_per_token = 1  # a character is at least one byte, each byte a token
            return
        hf = self.tok = HfTokenizer(self.model_dir)
        self.vocab_size = hf.vocab_size
        self.max_chars_per_token = min(hf.longest_token_chars, CHARS_PER_TOKEN_CAP)
        self.name = self.model_dir.name
        cfg_path = self.model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            self.bos = str(cfg.get("bos_token") or "")
            self.eos = str(cfg.get("eos_token") or "")
            tpl = cfg.get("chat_template")
            if isinstance(tpl, str) and tpl:
                import jinja2.sandbox

                self._template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(tpl)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        """Chat messages (role, content) → prompt text, ending where the assistant's answer starts."""
        msgs = [{"role": r, "content": c} for r, c in messages]
        if self._template is not None:
            return str(
                self._template.render(messages=msgs, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos)
            )
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"
