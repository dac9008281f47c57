"""Tool calls and reasoning in the router's chat answers: the forced calls (`tool_choice` "required" or a
named function, whose output the workers constrained to vLLM's tool-call schema: `kvmesh.openai.tools`) and,
with `--tool-call-parser NAME` and/or `--reasoning-parser NAME`, vLLM's own output parser
(`vllm.parser.ParserManager`: its tool parsers hermes, llama3_json, mistral, ... and reasoning parsers
deepseek_r1, qwen3, ...): the "auto" calls and the `reasoning` read from the text, whole (`Parser.parse`) or
streamed (`Parser.parse_delta`).

vLLM and transformers are imported only when a flag is set (at start: the parsers' tokenizer is the model
folder's, `AutoTokenizer`); a router without them never loads them. As vLLM's server: "auto" without a tool
parser is 400; an answer with parsed calls ends `tool_calls`; `parallel_tool_calls: false` keeps the first
call; the parser's request adjustments (hermes keeps special tokens) reach the sampling. Streamed "required"
calls come whole in the sequence's last delta (vLLM streams the array's parts as they parse); a named
function's arguments stream as the text comes. A forced call's answer is not read for reasoning.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.protocol import OpenAIRequest
from kvmesh.openai.responses import Decode, ResponseBuilder
from kvmesh.openai.tools import forced_calls, forced_choice, named_function, tool_call
from kvmesh.services.router.chunks import Chunk
from kvmesh.services.router.http_choices import Choices, PromptRun

AUTO_NEEDS_PARSER = (
    '"auto" tool choice requires --tool-call-parser on the router (vLLM: --enable-auto-tool-choice and '
    "--tool-call-parser)"
)


def new_call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class OutputParser:
    """vLLM's output parser class for the router's `--tool-call-parser` and `--reasoning-parser`, over the model
    folder's tokenizer (`tokenizer`: another one, for tests), loaded once."""

    def __init__(self, tools: str, reasoning: str, model_dir: Path | None, tokenizer: Any = None) -> None:
        if model_dir is None and tokenizer is None:
            raise InvalidArgument(
                "tool_call_parser", "needs the model folder (--model): the parser reads its tokenizer"
            )
        from vllm.parser.parser_manager import ParserManager

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer: Any = tokenizer
        self.tools, self.reasoning = bool(tools), bool(reasoning)
        try:  # an unknown name, or a reasoning parser whose tokens the tokenizer lacks
            self.parser_cls: Any = ParserManager.get_parser(
                tool_parser_name=tools or None,
                reasoning_parser_name=reasoning or None,
                enable_auto_tools=bool(tools),
                tokenizer=tokenizer,
            )
        except (TypeError, KeyError, ValueError) as e:
            raise InvalidArgument("tool_call_parser" if tools else "reasoning_parser", str(e)) from None

    def vllm_request(self, parsed: OpenAIRequest) -> Any:
        """vLLM's request object, which its parsers read (`tools`, `tool_choice`, `skip_special_tokens`)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = {"model": "", "messages": [], "tools": list(parsed.tools) or None, "tool_choice": parsed.tool_choice}
        return ChatCompletionRequest.model_validate(body | {"skip_special_tokens": parsed.sampling.skip_special_tokens})

    def new(self, vreq: Any) -> Any:
        """A parser for one sequence (a streaming one keeps state)."""
        return self.parser_cls(self.tokenizer, vreq.tools)


def parsed_answer(parsed: OpenAIRequest, parser: OutputParser | None) -> ParsedAnswer | None:
    """How a chat request's answer is read (None: plain text), or InvalidArgument for "auto" tool choice
    without a tool parser, before anything is routed."""
    if not parsed.chat:
        return None
    calls = bool(parsed.tools) and parsed.tool_choice != "none"
    if calls and parsed.tool_choice != "auto":
        return ParsedAnswer(parsed, None)  # forced: the schema made the output a call
    if calls and (parser is None or not parser.tools):
        raise InvalidArgument("tool_choice", AUTO_NEEDS_PARSER)
    if parser is None or not (calls or parser.reasoning):
        return None
    return ParsedAnswer(parsed, parser)


@dataclass(slots=True)
class _Seq:
    """One streamed choice: its parser (state), whether a call went out, its text so far (forced calls)."""

    parser: Any = None
    called: bool = False
    text: str = ""


class ParsedAnswer:
    """Rewrites one request's answer (whole body or SSE chunks) to carry its tool calls and reasoning."""

    def __init__(self, parsed: OpenAIRequest, parser: OutputParser | None) -> None:
        self.parsed = parsed  # `sampling` as the parser adjusts it (below): what the router sends the worker
        self.parser = parser  # None: forced calls ("required", named)
        self._auto = bool(parsed.tools) and parsed.tool_choice == "auto"
        self._vreq: Any = None
        if parser is not None:
            vreq = parser.vllm_request(parsed)
            self._vreq = parser.new(vreq).adjust_request(vreq)
            skip = bool(self._vreq.skip_special_tokens)  # hermes: False (its <tool_call> is special in some models)
            self.parsed = dataclasses.replace(
                parsed, sampling=dataclasses.replace(parsed.sampling, skip_special_tokens=skip)
            )
        self._seqs: dict[int, _Seq] = {}
        # the rendered prompt: whether the answer starts inside the reasoning (a template may open it);
        # set by the caller once tokenised
        self.prompt_ids: list[int] = []

    # ---- whole answers ---------------------------------------------------------------------------------
    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        """The answer with each choice's calls in `message.tool_calls` (and `message.reasoning`)."""
        choices = [self._whole_choice(c) for c in body.get("choices", [])]
        return {**body, "choices": choices}

    def _whole_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        if self.parser is None:
            return self._one_call_only(forced_choice(choice, self.parsed.tool_choice, new_call_id))
        msg = choice.get("message") or {}
        p = self.parser.new(self._vreq)
        reasoning, content, calls = p.parse(msg.get("content") or "", self._vreq, enable_auto_tools=self._auto)
        message = {**msg, "content": content}
        if self.parser.reasoning:
            message["reasoning"] = reasoning
        if not calls:
            return {**choice, "message": message}
        message["tool_calls"] = [tool_call(tc.id or new_call_id(), tc.name, tc.arguments) for tc in calls]
        return self._one_call_only({**choice, "message": message, "finish_reason": "tool_calls"})

    def _one_call_only(self, choice: dict[str, Any]) -> dict[str, Any]:
        """`parallel_tool_calls: false` keeps the first call (vLLM's `maybe_filter_parallel_tool_calls`)."""
        msg = choice.get("message") or {}
        if self.parsed.parallel_tool_calls or len(msg.get("tool_calls") or []) <= 1:
            return choice
        return {**choice, "message": {**msg, "tool_calls": msg["tool_calls"][:1]}}

    # ---- streamed answers -------------------------------------------------------------------------------
    def chunk(self, payload: dict[str, Any] | None, c: Chunk) -> dict[str, Any] | None:
        """An SSE chunk with its delta's text read for tool calls and reasoning (None: nothing to send yet)."""
        if payload is None:
            return None
        out = []
        for choice in payload.get("choices", []):
            step = self._stream_choice(choice, c)
            if step is not None:
                out.append(step)
        return {**payload, "choices": out} if out else None

    def _stream_choice(self, choice: dict[str, Any], c: Chunk) -> dict[str, Any] | None:
        seq = self._seqs.setdefault(int(choice.get("index", 0)), _Seq())
        old = choice.get("delta") or {}
        text = str(old.get("content") or "")
        finish = choice.get("finish_reason")
        delta: dict[str, Any] = {"role": old["role"]} if "role" in old else {}
        if self.parser is not None:
            delta |= self._parsed_delta(seq, text, c.token_ids, finish is not None)
        else:
            delta |= self._forced_delta(seq, text, finish is not None)
        if seq.called and finish == "stop" and named_function(self.parsed.tool_choice) is None:
            finish = "tool_calls"  # an "auto" or "required" answer that called (vLLM's rule)
        if not delta and finish is None and not choice.get("logprobs"):
            return None
        return {**choice, "delta": delta, "finish_reason": finish}

    def _forced_delta(self, seq: _Seq, text: str, last: bool) -> dict[str, Any]:
        seq.text += text
        name = named_function(self.parsed.tool_choice)
        if name is not None:  # the arguments as they come, the call's head first
            head = {"id": new_call_id(), "type": "function"} if not seq.called else {}
            fn = ({"name": name} if not seq.called else {}) | {"arguments": text}
            if seq.called and not text:
                return {}
            seq.called = True
            return {"tool_calls": [{"index": 0, **head, "function": fn}]}
        if not last:
            return {}
        calls = forced_calls(seq.text, self.parsed.tool_choice, new_call_id)
        if calls is None:  # not an array of calls (cut by the length limit): the text, as it came
            return {"content": seq.text}
        seq.called = True
        calls = calls if self.parsed.parallel_tool_calls else calls[:1]
        return {"tool_calls": [{"index": i, **tc} for i, tc in enumerate(calls)]}

    def _parsed_delta(self, seq: _Seq, text: str, ids: list[int], last: bool) -> dict[str, Any]:
        assert self.parser is not None
        if seq.parser is None:
            seq.parser = self.parser.new(self._vreq)
        msg = seq.parser.parse_delta(text, list(ids), self._vreq, self.prompt_ids, finished=last)
        delta: dict[str, Any] = msg.model_dump(exclude_none=True) if msg is not None else {}
        delta.pop("role", None)
        calls = [
            tc for tc in delta.pop("tool_calls", None) or [] if self.parsed.parallel_tool_calls or tc.get("index") == 0
        ]
        if calls:
            seq.called = True
            delta["tool_calls"] = calls
        return delta


class ParsedChoices(Choices):
    """An answer's choices (`Choices`) whose chunks and whole body carry the request's tool calls."""

    def __init__(
        self,
        answer: ParsedAnswer,
        build: ResponseBuilder,
        runs: Sequence[PromptRun],
        n: int,
        logprobs: bool,
        decode: Decode,
    ) -> None:
        super().__init__(build, runs, n, logprobs, decode)
        self.answer = answer

    def step(self, prompt: int, c: Chunk) -> dict[str, Any] | None:
        return self.answer.chunk(super().step(prompt, c), c)

    def whole(self) -> dict[str, Any]:
        return self.answer.whole(super().whole())
