"""Static warming templates from configuration (YAML/JSON-shaped data: a list of mappings).

Each template: `name`, `token_ids` (a list of ints) or `text` (tokenised by the caller), and optional
`replicas` (how many workers should hold it; default 1, 0 = every worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Template:
    """A prefix to preload at start."""

    name: str
    token_ids: tuple[int, ...]
    replicas: int = 1


def load_templates(
    items: Iterable[Mapping[str, object]], tokenize: Callable[[str], Sequence[int]] | None = None
) -> list[Template]:
    """Validate config items into templates; `text` needs `tokenize`."""
    out = []
    for i, it in enumerate(items):
        name = str(it.get("name", f"template-{i}"))
        if "token_ids" in it:
            toks = tuple(int(t) for t in it["token_ids"])  # type: ignore[attr-defined]
        elif "text" in it:
            if tokenize is None:
                raise ValueError(f"template {name!r}: text needs a tokenizer")
            toks = tuple(int(t) for t in tokenize(str(it["text"])))
        else:
            raise ValueError(f"template {name!r}: needs token_ids or text")
        replicas = int(it.get("replicas", 1))  # type: ignore[call-overload]
        if replicas < 0 or not toks:
            raise ValueError(f"template {name!r}: replicas must be ≥ 0 and tokens non-empty")
        out.append(Template(name, toks, replicas))
    return out
