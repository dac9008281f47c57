"""An OpenAI request's output constraint (pure): `response_format` and vLLM's `structured_outputs` read into
one `kvmesh.core.generation.StructuredOutput` as vLLM 0.32 reads them, or `InvalidArgument` naming the field
(`response_format.json_schema.schema`, `structured_outputs.regex` ...). A forced tool call's constraint is
`kvmesh.openai.tools.forced_call_sampling`'s, which replaces this one as vLLM's does.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import StructuredOutput
from kvmesh.openai.values import check_keys, check_text

# vLLM's StructuredOutputsParams: one constraint each, and the options kvmesh takes only at their defaults
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_DEFAULTS: dict[str, object] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}
_RF_TYPES = ("text", "json_object", "json_schema")


def parse_structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The output constraint of `response_format` and vLLM's `structured_outputs` (`response_format`'s wins
    where both set one, as vLLM; two different constraints are refused)."""
    so = _structured_outputs(body.get("structured_outputs"))
    rf = _response_format(body.get("response_format"))
    if rf is not None and so is not None and rf.kind != so.kind:
        raise InvalidArgument("response_format", "only one kind of structured output: it and structured_outputs")
    return rf or so


def _response_format(rf: object) -> StructuredOutput | None:
    """`{"type": "text"}` (None), `json_object`, or `json_schema` whose `json_schema.schema` is an object."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidArgument("response_format", "must be an object")
    kind = rf.get("type")
    if kind not in _RF_TYPES:
        got = json.dumps(kind) if isinstance(kind, str | None) else "a non-string"
        raise InvalidArgument("response_format.type", f"one of {', '.join(_RF_TYPES)}, got {got}")
    check_keys(rf, ("type", "json_schema"), "response_format", "unknown key")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("response_format", "type json_schema needs a json_schema object (as vLLM)")
    if not isinstance(spec.get("name"), str):
        raise InvalidArgument("response_format.json_schema.name", "a string is required")
    for key in ("description", "strict"):
        if spec.get(key) is not None and not isinstance(spec[key], bool if key == "strict" else str):
            raise InvalidArgument(f"response_format.json_schema.{key}", "wrong type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidArgument("response_format.json_schema.schema", "must be a JSON schema object")
    return StructuredOutput(json_schema=json.dumps(schema))


def _structured_outputs(so: object) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: exactly one of json (a schema object or its JSON text), regex, choice,
    grammar, json_object; its options only at their defaults (kvmesh's wire carries none)."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidArgument("structured_outputs", "must be an object")
    check_keys(so, (*_CONSTRAINTS, *_SO_DEFAULTS), "structured_outputs", "unknown key")
    for key, default in _SO_DEFAULTS.items():
        if so.get(key) is not None and so[key] != default:
            raise InvalidArgument(f"structured_outputs.{key}", "only its default is served")
    given = [k for k in _CONSTRAINTS if so.get(k) is not None]
    if len(given) != 1:
        raise InvalidArgument("structured_outputs", f"exactly one constraint of {', '.join(_CONSTRAINTS[:5])}")
    kind, value = given[0], so[given[0]]
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, dict):
            return StructuredOutput(json_schema=json.dumps(value))
        if isinstance(value, str):
            return StructuredOutput(json_schema=check_text(value, where))
        raise InvalidArgument(where, "a JSON schema object or its JSON text")
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(where, "must be true")
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(where, "must be a non-empty list of strings")
        return StructuredOutput(choice=tuple(check_text(c, where) for c in value))
    if kind == "structural_tag":
        raise InvalidArgument(where, "not supported: kvmesh's structured output has no structural tags")
    if not isinstance(value, str):
        raise InvalidArgument(where, "must be a string")
    text = check_text(value, where)
    return StructuredOutput(regex=text) if kind == "regex" else StructuredOutput(grammar=text)
