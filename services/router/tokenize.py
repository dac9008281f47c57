"""Tokenisation in the router (once per request): HF `tokenizers` from the served model's folder.

Model folder resolution: `--model`, else `$KVMESH_HOME/models/tiny-llama`, else
`~/.cache/kvmesh/models/tiny-llama` (built by `scripts/build_tiny_model.py`); with no folder at all the
router uses the simulated engine's byte tokenizer (`kvmesh.engine.tokenizer.ByteTokenizer`), which is what
sim workers without a model use. Chat messages are rendered with the folder's `chat_template`
(tokenizer_config.json, Jinja) when it has one, else as `<|role|>\\ncontent\\n` lines ending with
`<|assistant|>\\n`. The template is rendered as vLLM renders it: by transformers' `render_jinja_template`
(what `apply_chat_template` calls: its sandbox, filters, `continue_final_message`), with the request's
`tools`, `add_generation_prompt`, `continue_final_message`, the tokenizer's special tokens and those
`chat_template_kwargs` the template reads (vLLM's `resolve_chat_template_kwargs` drops the others).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.token_cache import TokenCache
from kvmesh.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from kvmesh.openai.protocol import Message, OpenAIRequest

log = logging.getLogger(__name__)

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # as transformers passes them
CHARS_PER_TOKEN_CAP = 32  # assumed at most, whatever the vocabulary's longest entry (a few are long runs)


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """What a chat request adds to its messages for the template (OpenAI's `tools`, vLLM's options)."""

    tools: tuple[dict[str, Any], ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def of(cls, parsed: OpenAIRequest) -> ChatTemplateOptions:
        """A parsed HTTP request's; `tool_choice: "none"` still renders the tools, as vLLM does by default."""
        return cls(
            parsed.tools, parsed.chat_template_kwargs, parsed.add_generation_prompt, parsed.continue_final_message
        )

    @property
    def chars(self) -> int:
        """The JSON size of the tools and kwargs, counted against the prompt's character bound."""
        return len(json.dumps(self.tools)) + len(json.dumps(self.kwargs)) if self.tools or self.kwargs else 0


class RouterTokenizer:
    """encode / decode / render_chat for one model, and the cache of its tokenised texts."""

    def __init__(self, model: str = "", cache_mb: int = 0) -> None:
        if cache_mb < 0:
            raise InvalidArgument("tokenize_cache_mb", f"must be >= 0 MiB (0 = off), got {cache_mb}")
        self.cache = TokenCache(cache_mb * 2**20)
        self.model_dir = resolve_model_dir(model)
        self.tok: Tokenizer
        self._template: str | None = None
        self._template_vars: frozenset[str] = frozenset()
        self._special: dict[str, str] = {}
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
            self._special = {k: str(cfg[k]) for k in _SPECIAL_TOKENS if isinstance(cfg.get(k), str)}
            tpl = cfg.get("chat_template")
            if isinstance(tpl, str) and tpl:
                import jinja2.meta
                import jinja2.sandbox

                self._template = tpl
                env = jinja2.sandbox.ImmutableSandboxedEnvironment()
                self._template_vars = frozenset(jinja2.meta.find_undeclared_variables(env.parse(tpl)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def render_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] = (),
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """Chat messages → prompt text, ending where the assistant's answer starts (or, with
        `continue_final_message`, inside the last message); a template's refusal is InvalidArgument."""
        msgs = [m.template_dict() for m in messages]
        if self._template is None:
            if tools or template_kwargs or continue_final_message:
                raise InvalidArgument("messages", "the model has no chat template to render tools or options with")
            tail = "<|assistant|>\n" if add_generation_prompt else ""
            return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + tail
        from transformers.utils.chat_template_utils import render_jinja_template

        render: Any = render_jinja_template  # typed for one conversation's str in some versions, a tuple in 5.x

        own = {"messages", "tools", "add_generation_prompt", "continue_final_message", "documents", *self._special}
        extra = {k: v for k, v in (template_kwargs or {}).items() if k in self._template_vars and k not in own}
        try:
            rendered, _ = render(
                conversations=[msgs],
                tools=list(tools) or None,
                chat_template=self._template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **self._special,
                **extra,
            )
        except Exception as e:  # the template refused the chat (raise_exception, a missing final message ...)
            raise InvalidArgument("messages", f"the chat template refused it: {e}") from None
        return str(rendered[0])
