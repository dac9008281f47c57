"""Output guardrails (pure): rules that mask or stop generated text, applied to a stream chunk by chunk.

A rule is a regular expression or a word list (whole words, case-insensitive: ``(?<!\\w)(?:w1|w2|…)(?!\\w)``
with the words escaped, as a trie so the longest is tried first), an action (``mask``: the span becomes the
rule's mask, ``***`` by default; ``stop``: the stream ends before the span, OpenAI's ``finish_reason:
content_filter``) and the tenants it applies to (default all). Rules come from YAML (:func:`parse_rule_file`;
reading the files is the caller's) as::

    rules:
      - name: api-keys
        pattern: "sk-[A-Za-z0-9]{20,48}"
        max_match_chars: 56        # optional, regex rules: longest match, characters (default 64)
        action: mask
        mask: "[key]"              # optional, default ***
      - name: banned
        words_file: banned.txt     # one word or phrase a line, '#' comments; or `words: [a, b]`
        action: stop
        tenants: [alice, bob]      # optional, default: every tenant

**Hold-back.** A stream keeps back the tail of its text that could still be the start of a match:

    reach(rule) = longest word of the list (characters)   |   max_match_chars (regex)
    H           = max reach over the rules that apply to the stream's tenant
    decided     = a match starting at index s of the held text B, when s < len(B) − H or the stream ended
    released    = B[: max(len(B) − H, end of the last decided mask span)]    (B[: s] for a decided stop at s)

A match of at most H characters starting before len(B) − H lies inside B with at least one character after it
(the ``(?!\\w)`` look-ahead of a word), so more text cannot change it; a later start is re-examined once more
text arrived. The last H + 1 released characters stay as look-behind context: a match may start in them and
end in new text (two overlapping matches, the first one masked), and the search starts one character in, so
``^`` / ``\\A`` match only at the stream's start. Matches of a rule may overlap (each start is searched);
overlapping or touching mask spans are merged into one mask, as is a span that continues a mask released with
the chunk before. A stop whose start lies in a decided mask span still stops: the release ends before an
undecided stop. A regex match longer than ``max_match_chars`` is masked whole (its continuation starts in the
context), but a ``stop`` for it may come after its start was sent. Matching is per code point, without
normalisation (``café`` as NFC and as NFD are different texts); case-insensitive word matching is Python's
``re.IGNORECASE`` (simple case folding, one character for one, so a match has the word's length).

A :class:`RuleSet` is immutable; a watcher swaps the current one, and a stream takes the current set at each
chunk (:meth:`GuardedText.feed` takes the rules as an argument), so it obeys new rules from its next chunk.
:class:`GuardedTokens` keeps token ids in step with the text: a step's ids are released with the last character
of its text, so a stopped stream sends neither the text nor the ids of the matched span.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml

DEFAULT_MAX_MATCH_CHARS = 64
MAX_MATCH_CHARS_LIMIT = 4096  # a larger hold-back would delay a stream by that many characters
MAX_WORD_CHARS = 256  # longest word or phrase of a word list (the trie regex nests that deep)
DEFAULT_MASK = "***"


class Action(enum.StrEnum):
    """What a match does to the stream."""

    MASK = "mask"
    STOP = "stop"


class RuleError(ValueError):
    """A rule file is invalid; the message names the file, the line and the rule."""


@dataclass(frozen=True)
class Rule:
    """One compiled rule; `reach`: its longest match (characters); `source`: ``file:line``."""

    name: str
    regex: re.Pattern[str]
    action: Action
    reach: int
    tenants: frozenset[str] | None = None  # None: every tenant
    mask: str = DEFAULT_MASK
    source: str = ""

    def applies_to(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


@dataclass(frozen=True)
class TenantRules:
    """The rules of one tenant, and their hold-back H (see the module docstring)."""

    rules: tuple[Rule, ...] = ()

    @property
    def hold(self) -> int:
        return max((r.reach for r in self.rules), default=0)


@dataclass(frozen=True)
class RuleSet:
    """Every rule, in file order (names unique); `version` counts successful loads."""

    rules: tuple[Rule, ...] = ()
    version: int = 0
    _by_tenant: dict[str, TenantRules] = field(default_factory=dict, compare=False, repr=False)

    def for_tenant(self, tenant: str) -> TenantRules:
        got = self._by_tenant.get(tenant)
        if got is None:
            got = TenantRules(tuple(r for r in self.rules if r.applies_to(tenant)))
            if len(self._by_tenant) < 4096:  # bounded: tenants are client-named until auth binds them
                self._by_tenant[tenant] = got
        return got


class Match(NamedTuple):
    """A match of `rule` over [start, end) of a searched text."""

    start: int
    end: int
    rule: Rule


# ---- compiling rules ---------------------------------------------------------------------------------------
def words_regex(words: Iterable[str]) -> tuple[re.Pattern[str], int]:
    """The whole-word, case-insensitive regex of `words` (inner whitespace runs become one space) and its reach.
    The alternation is a trie (``ab(?:c|d)``, a word that is a prefix of another made optional, so the longest
    is tried first): its cost at a position grows with the words' length, not their number."""
    clean = {"".join(_fold(ch) for ch in " ".join(w.split())) for w in words if w.strip()}
    if not clean:
        raise ValueError("the word list is empty")
    longest = max(len(w) for w in clean)
    if longest > MAX_WORD_CHARS:
        raise ValueError(f"a word is longer than {MAX_WORD_CHARS} characters")
    trie: dict[str, Any] = {}
    for w in clean:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here
    return re.compile(rf"(?<!\w){_trie_regex(trie)}(?!\w)", re.IGNORECASE), longest


def _fold(ch: str) -> str:
    """`ch` lower-cased where that keeps it one character (the trie merges case variants; IGNORECASE matches)."""
    low = ch.lower()
    return low if len(low) == 1 else ch


def _trie_regex(node: dict[str, Any]) -> str:
    """The regex of a trie node's words (recursion depth: the longest word, at most MAX_WORD_CHARS)."""
    alts = [re.escape(ch) + _trie_regex(child) for ch, child in sorted(node.items()) if ch]
    if not alts:
        return ""
    if len(alts) == 1 and "" not in node:
        return alts[0]
    group = "(?:" + "|".join(alts) + ")"
    return group + "?" if "" in node else group


def parse_words(text: str) -> list[str]:
    """A words file: one word or phrase a line; blank lines and lines starting with '#' are skipped."""
    return [s for s in (ln.strip() for ln in text.splitlines()) if s and not s.startswith("#")]


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A rule's regex; one that can match the empty string is refused (it would match everywhere)."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"pattern does not compile: {e}") from None
    if rx.fullmatch("") is not None:
        raise ValueError("pattern matches the empty string")
    return rx


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader whose mappings remember their line (key ``__line__``), for errors that name it."""


def _mapping_with_line(loader: _LineLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    out = loader.construct_mapping(node, deep=True)
    out["__line__"] = node.start_mark.line + 1
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_with_line)


@dataclass(frozen=True)
class RuleSpec:
    """A rule as written in a file, before its words file is read; `line`: where it starts."""

    fields: Mapping[str, Any]
    source: str
    line: int

    @property
    def name(self) -> str:
        return str(self.fields.get("name", ""))

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}: rule {self.name!r}" if self.name else f"{self.source}:{self.line}: rule"

    @property
    def words_file(self) -> str | None:
        v = self.fields.get("words_file")
        return v if isinstance(v, str) else None


_KEYS = {"name", "pattern", "words", "words_file", "action", "mask", "tenants", "max_match_chars", "__line__"}


def parse_rule_file(text: str, source: str) -> list[RuleSpec]:
    """The rule specs of one YAML file (`source` names it in errors); RuleError when it is malformed or empty."""
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise RuleError(f"{source}{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if doc is None:  # an empty file is more likely a write caught half-way than a wish for no rules
        raise RuleError(f"{source}: empty (write `rules: []` for no rules)")
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise RuleError(f"{source}:1: expected a mapping with a list `rules:` (`rules: []` for none)")
    specs = []
    for i, r in enumerate(doc.get("rules") or []):
        if not isinstance(r, dict):
            raise RuleError(f"{source}: rules[{i}]: expected a mapping (name, pattern | words | words_file, action)")
        specs.append(RuleSpec(r, source, int(r["__line__"])))
    return specs


def compile_rule(spec: RuleSpec, words_text: str | None, default_max_match: int) -> Rule:
    """A spec compiled; `words_text`: its words file's content (None when it names none). RuleError naming the
    file, line and rule when a field is missing or wrong."""
    try:
        return _compile(spec.fields, words_text, default_max_match, f"{spec.source}:{spec.line}")
    except (ValueError, TypeError) as e:
        raise RuleError(f"{spec.where}: {e}") from None


def _compile(f: Mapping[str, Any], words_text: str | None, default_max_match: int, source: str) -> Rule:
    unknown = sorted(set(f) - _KEYS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(str, unknown))}")
    name = f.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
        raise ValueError("`name` must be 1-64 characters of letters, digits, _ . : -")
    sources = [k for k in ("pattern", "words", "words_file") if k in f]
    if len(sources) != 1:
        raise ValueError("give exactly one of `pattern`, `words`, `words_file`")
    regex, reach = _matcher(f, sources[0], words_text, default_max_match)
    action = f.get("action")
    if action not in (Action.MASK.value, Action.STOP.value):
        raise ValueError("`action` must be mask or stop")
    mask = f.get("mask", DEFAULT_MASK)
    if not isinstance(mask, str):
        raise ValueError("`mask` must be a string")
    return Rule(name, regex, Action(action), reach, _tenants(f.get("tenants")), mask, source)


def _matcher(
    f: Mapping[str, Any], kind: str, words_text: str | None, default_max_match: int
) -> tuple[re.Pattern[str], int]:
    if kind == "pattern":
        if not isinstance(f["pattern"], str):
            raise ValueError("`pattern` must be a string")
        reach = f.get("max_match_chars", default_max_match)
        if isinstance(reach, bool) or not isinstance(reach, int) or not 1 <= reach <= MAX_MATCH_CHARS_LIMIT:
            raise ValueError(f"`max_match_chars` must be an integer in [1, {MAX_MATCH_CHARS_LIMIT}]")
        return pattern_regex(f["pattern"]), reach
    if "max_match_chars" in f:
        raise ValueError("`max_match_chars` is for `pattern` rules (a word list's is its longest word)")
    if kind == "words":
        words = f["words"]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError("`words` must be a list of strings")
    else:
        if not isinstance(f["words_file"], str) or words_text is None:
            raise ValueError("`words_file` must name a file")
        words = parse_words(words_text)
    return words_regex(words)


def _tenants(v: Any) -> frozenset[str] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(t, str) for t in v):
        raise ValueError("`tenants` must be a non-empty list of tenant names")
    return frozenset(v)


def build_rule_set(
    specs: Sequence[RuleSpec], read_words: Callable[[RuleSpec], str | None], default_max_match: int, version: int
) -> RuleSet:
    """Compiles `specs` (`read_words`: a spec's words-file text, the caller's I/O); RuleError on the first
    bad rule or a repeated name."""
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for spec in specs:
        rule = compile_rule(spec, read_words(spec) if spec.words_file is not None else None, default_max_match)
        if rule.name in seen:
            raise RuleError(f"{spec.where}: the name is already used at {seen[rule.name]}")
        seen[rule.name] = f"{spec.source}:{spec.line}"
        rules.append(rule)
    return RuleSet(tuple(rules), version)


# ---- matching ----------------------------------------------------------------------------------------------
def find_matches(rules: TenantRules, text: str, pos: int, after: int) -> list[Match]:
    """Every non-empty match of every rule starting at or after `pos` and ending after `after`, overlapping
    ones included (each start is searched), by start then rule order."""
    out: list[Match] = []
    for rule in rules.rules:
        p = pos
        while (m := rule.regex.search(text, p)) is not None:
            if m.end() > m.start() and m.end() > after:
                out.append(Match(m.start(), m.end(), rule))
            p = m.start() + 1
    order = {id(r): i for i, r in enumerate(rules.rules)}
    out.sort(key=lambda m: (m.start, order[id(m.rule)]))
    return out


def merge_spans(spans: Iterable[Match]) -> list[Match]:
    """Overlapping or touching spans joined (the first span's rule gives the mask), in order."""
    out: list[Match] = []
    for s in sorted(spans, key=lambda m: m.start):
        if out and s.start <= out[-1].end:
            last = out[-1]
            out[-1] = Match(last.start, max(last.end, s.end), last.rule)
        else:
            out.append(s)
    return out


def apply_masks(text: str, spans: Sequence[Match], continued: bool = False) -> str:
    """`text` with each (merged, in-range) span replaced by its rule's mask; `continued`: the text before
    `text` ended in a mask, so a span at 0 continues it (one mask, not two)."""
    parts, at = [], 0
    for s in spans:
        mask = "" if continued and s.start == 0 else s.rule.mask
        parts += [text[at : s.start], mask]
        at = s.end
    parts.append(text[at:])
    return "".join(parts)


@dataclass(frozen=True)
class Filtered:
    """What one step releases: `text` (masked), `raw_released` (characters of the stream's own text released
    so far, masked or not), the decided `matches` (for metrics), and `stopped`: the stop rule that ended it."""

    text: str
    raw_released: int
    matches: tuple[Match, ...] = ()
    stopped: Rule | None = None


class GuardedText:
    """The guardrail state of one stream's text: the held tail and the released context (module docstring)."""

    __slots__ = ("_ctx", "_held", "_released", "_tail_masked", "stopped")

    def __init__(self) -> None:
        self._ctx = ""  # the last H + 1 released characters, unmasked
        self._held = ""
        self._released = 0
        self._tail_masked = False  # the last released character was masked
        self.stopped: Rule | None = None

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str, rules: TenantRules, final: bool = False) -> Filtered:
        """Adds `text` and releases what can no longer be part of a match under `rules` (all of it if
        `final`); after a stop, nothing more."""
        if self.stopped is not None:
            return Filtered("", self._released)
        self._held += text
        if not rules.rules:
            return self._release(len(self._held), [], None, 0)
        return self._scan(rules, final)

    def _scan(self, rules: TenantRules, final: bool) -> Filtered:
        h, held, base = rules.hold, self._held, len(self._ctx)
        truncated = self._released > base  # the context does not start at the stream's start: skip its first
        found = find_matches(rules, self._ctx + held, max(base - h, 1 if truncated else 0), base)
        local = [Match(m.start - base, m.end - base, m.rule) for m in found]
        limit = len(held) if final else len(held) - h
        stop = next((m for m in local if m.rule.action is Action.STOP), None)
        if stop is not None and stop.start < limit:  # a decided stop: release what comes before it
            cut = max(stop.start, 0)
            fired = [m for m in local if m.start < stop.start or m is stop]
            return self._release(cut, _mask_spans(fired, cut), stop.rule, h, fired)
        decided = [m for m in local if m.start < limit]
        upto = max(limit, max((m.end for m in decided), default=0), 0)
        if stop is not None:  # an undecided stop inside a mask span keeps its text held, so it can still stop
            upto = min(upto, max(stop.start, 0))
        return self._release(upto, _mask_spans(decided, upto), None, h, decided)

    def _release(
        self, upto: int, spans: list[Match], stop: Rule | None, h: int, fired: Sequence[Match] = ()
    ) -> Filtered:
        raw, self._held = self._held[:upto], self._held[upto:]
        self._released += len(raw)
        self._ctx = (self._ctx + raw)[-(h + 1) :]
        text = apply_masks(raw, spans, continued=self._tail_masked)
        if raw:
            self._tail_masked = bool(spans) and spans[-1].end == len(raw)
        if stop is not None:
            self.stopped, self._held = stop, ""
        return Filtered(text, self._released, tuple(m for m in fired if m.start >= 0), stop)


def _mask_spans(matches: Iterable[Match], upto: int) -> list[Match]:
    """The merged mask spans of `matches` (held-text coordinates), clipped to [0, upto)."""
    clipped = (Match(max(m.start, 0), min(m.end, upto), m.rule) for m in matches if m.rule.action is Action.MASK)
    return merge_spans(m for m in clipped if m.start < m.end)


@dataclass(frozen=True)
class GuardedStep:
    """What one stream step sends: text, the token ids released with it, the rules that fired, a stop."""

    text: str
    token_ids: list[int]
    matches: tuple[Match, ...] = ()
    stopped: Rule | None = None


class GuardedTokens:
    """`GuardedText` with token ids kept in step: a step's ids go out with the last character of its text
    (ids of a step without text go with the text before them); a stop drops the ids still held."""

    __slots__ = ("_pending", "_raw_total", "text")

    def __init__(self) -> None:
        self.text = GuardedText()
        self._pending: deque[tuple[int, list[int]]] = deque()  # (raw text end of the step, its token ids)
        self._raw_total = 0

    def step(self, token_ids: Sequence[int], text: str, rules: TenantRules, final: bool = False) -> GuardedStep:
        """One stream step (its token ids and text) through the rules; `final` on the stream's last step."""
        if self.text.stopped is not None:
            return GuardedStep("", [])
        self._raw_total += len(text)
        if token_ids:
            self._pending.append((self._raw_total, list(token_ids)))
        f = self.text.feed(text, rules, final)
        ids: list[int] = []
        while self._pending and self._pending[0][0] <= f.raw_released:
            ids += self._pending.popleft()[1]
        if f.stopped is not None:
            self._pending.clear()  # the ids of the stopped span are never sent
        return GuardedStep(f.text, ids, f.matches, f.stopped)
