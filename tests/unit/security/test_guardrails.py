"""The output guardrail matcher (kvmesh.security.guardrails): rule files, hold-back across chunks, masks, stops."""

from __future__ import annotations

import itertools
import re

import pytest

from kvmesh.security.guardrails import (
    GuardedText,
    GuardedTokens,
    RuleError,
    RuleSet,
    TenantRules,
    build_rule_set,
    parse_rule_file,
)


def rules(yaml_text: str, words: dict[str, str] | None = None, default_max: int = 64) -> RuleSet:
    specs = parse_rule_file(yaml_text, "g.yaml")
    return build_rule_set(specs, lambda s: (words or {}).get(s.words_file or ""), default_max, 1)


def run(parts: list[str], tr: TenantRules) -> tuple[str, GuardedText]:
    """`parts` streamed as chunks, then the end of the stream."""
    g = GuardedText()
    out = "".join(g.feed(p, tr).text for p in parts)
    return out + g.feed("", tr, final=True).text, g


WORDS = rules(
    """
rules:
  - name: secrets
    words: [secret, "top secret", passwort]
    action: mask
"""
).for_tenant("")
TEXT = "a top secret, the SECRET. secretive secrets; Secret-x _secret Passwort!"
MASKED = "a ***, the ***. secretive secrets; ***-x _secret ***!"


def test_words_are_whole_case_insensitive_and_longest_first() -> None:
    assert run([TEXT], WORDS)[0] == MASKED
    assert WORDS.hold == len("top secret")


def test_two_chunks_at_every_split_point() -> None:
    for i in range(len(TEXT) + 1):
        assert run([TEXT[:i], TEXT[i:]], WORDS)[0] == MASKED, i


def test_three_chunks_at_every_pair_of_split_points() -> None:
    text = "x secret y top secret z"
    want = "x *** y *** z"
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert run([text[:i], text[i:j], text[j:]], WORDS)[0] == want, (i, j)


def test_one_character_a_chunk_and_the_hold_back_bound() -> None:
    g = GuardedText()
    out = []
    for ch in TEXT:
        out.append(g.feed(ch, WORDS).text)
        assert len(g.held) <= WORDS.hold  # nothing is held longer than H characters without a pending match
    out.append(g.feed("", WORDS, final=True).text)
    assert "".join(out) == MASKED


def test_text_is_released_once_it_cannot_start_a_match() -> None:
    g = GuardedText()
    f = g.feed("hello world, how are you", WORDS)
    assert f.text == "hello world, h" and g.held == "ow are you"  # H = 10 characters held
    assert g.feed("", WORDS, final=True).text == "ow are you"


def test_regex_split_at_every_point_and_matches_counted_once() -> None:
    tr = rules(
        'rules: [{name: key, pattern: "sk-[a-z0-9]{6}", max_match_chars: 9, action: mask, mask: "[key]"}]'
    ).for_tenant("")
    text = "use sk-abc123 or sk-zz9zz9 now"
    for i in range(len(text) + 1):
        g = GuardedText()
        fs = [g.feed(text[:i], tr), g.feed(text[i:], tr), g.feed("", tr, final=True)]
        assert "".join(f.text for f in fs) == "use [key] or [key] now", i
        assert sum(len(f.matches) for f in fs) == 2, i


def test_overlapping_matches_are_merged_into_one_mask() -> None:
    tr = rules(
        """
rules:
  - {name: abc, pattern: abc, action: mask}
  - {name: bcd, pattern: bcd, action: mask}
  - {name: aa, pattern: aa, action: mask}
"""
    ).for_tenant("")
    for text, want in (("zabcdz", "z***z"), ("baaab", "b***b"), ("abcaa", "***")):
        for i in range(len(text) + 1):
            assert run([text[:i], text[i:]], tr)[0] == want, (text, i)


def test_a_match_longer_than_max_match_chars_is_masked_whole_as_one_mask() -> None:
    tr = rules('rules: [{name: digits, pattern: "[0-9]+", max_match_chars: 4, action: mask}]').for_tenant("")
    text = "pin 1234567890123 ok"
    assert run(list(text), tr)[0] == "pin *** ok"
    assert run([text], tr)[0] == "pin *** ok"


def test_unicode_words_split_everywhere() -> None:
    tr = rules(
        "rules: [{name: u, words: [секрет, café, 秘密, straße], action: mask}]",
    ).for_tenant("")
    text = "Это СЕКРЕТ! 🙂 CAFÉ au lait, 秘密 und STRASSE, Straße🙂секретный"
    want = "Это ***! 🙂 *** au lait, *** und STRASSE, ***🙂секретный"
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], tr)[0] == want, i


def test_stop_ends_before_the_match_and_then_sends_nothing() -> None:
    tr = rules(
        """
rules:
  - {name: s, words: [forbidden], action: stop}
  - {name: m, words: [secret], action: mask}
"""
    ).for_tenant("")
    text = "one secret then forbidden fruit and secret"
    for i in range(len(text) + 1):
        out, g = run([text[:i], text[i:]], tr)
        assert out == "one *** then ", i
        assert g.stopped is not None and g.stopped.name == "s"
        assert g.feed("more text", tr).text == ""


def test_a_stop_inside_a_mask_span_still_stops() -> None:
    tr = rules(
        """
rules:
  - {name: m, words: [top secret plan], action: mask}
  - {name: s, words: [secret], action: stop}
"""
    ).for_tenant("")
    for text in ("a top secret plan b", "a top secret"):
        for i in range(len(text) + 1):
            out, g = run([text[:i], text[i:]], tr)
            assert g.stopped is not None and g.stopped.name == "s", (text, i)
            assert "secret" not in out, (text, i)


def test_a_large_word_list_with_shared_prefixes_and_case_variants() -> None:
    words = [f"w{i:04d}x" for i in range(5000)] + ["ab", "abc", "ABCD", "İstanbul", "Secret", "secret"]
    tr = rules("rules: [{name: many, words_file: w.txt, action: mask}]", {"w.txt": "\n".join(words)}).for_tenant("")
    text = "w0042x w0042 abcd ab abcde istanbul İSTANBUL SECRET w4999x"
    want = "*** w0042 *** *** abcde *** *** *** ***"  # re.IGNORECASE: İ matches i
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], tr)[0] == want, i


def test_per_tenant_rules() -> None:
    rs = rules(
        """
rules:
  - {name: everyone, words: [alpha], action: mask}
  - {name: alice-only, words: [beta], action: mask, tenants: [alice]}
  - {name: bob-only, words: [beta], action: stop, tenants: [bob]}
"""
    )
    text = "alpha beta gamma"
    assert run([text], rs.for_tenant("alice"))[0] == "*** *** gamma"
    out, g = run([text], rs.for_tenant("bob"))
    assert out == "*** " and g.stopped is not None and g.stopped.name == "bob-only"
    assert run([text], rs.for_tenant(""))[0] == "*** beta gamma"
    assert rs.for_tenant("carol").hold == len("alpha")


def test_new_rules_apply_from_the_next_chunk_to_the_held_text() -> None:
    old = rules("rules: [{name: a, words: [apple], action: mask}]").for_tenant("")
    new = rules("rules: [{name: b, words: [banana], action: mask}]").for_tenant("")
    g = GuardedText()
    first = g.feed("an apple and a bana", old).text
    assert first.startswith("an *** ") and "bana" in g.held  # held back: could be the start of a word
    rest = g.feed("na split, apple again", new).text + g.feed("", new, final=True).text
    assert first + rest == "an *** and a *** split, apple again"


def test_no_rules_releases_everything_and_anchors_match_only_at_the_start() -> None:
    g = GuardedText()
    assert g.feed("abc", TenantRules()).text == "abc" and g.held == ""
    tr = rules('rules: [{name: hi, pattern: "^Hello", max_match_chars: 5, action: mask}]').for_tenant("")
    assert run(list("Hello Hello Hello"), tr)[0] == "*** Hello Hello"


def test_tokens_go_out_with_the_last_character_of_their_text_and_a_stop_drops_them() -> None:
    tr = rules("rules: [{name: s, words: [stopword], action: stop}]").for_tenant("")
    g = GuardedTokens()
    steps = [([1], "hello "), ([2], "there "), ([3], "stop"), ([4], "word"), ([5], " after")]
    sent_text, sent_ids = [], []
    for ids, text in steps:
        s = g.step(ids, text, tr)
        sent_text.append(s.text)
        sent_ids += s.token_ids
        if s.stopped:
            break
    assert "".join(sent_text) == "hello there "
    assert sent_ids == [1, 2]  # the ids of "stop" + "word" never go out
    g2 = GuardedTokens()
    got = [g2.step(ids, text, tr) for ids, text in steps[:2]] + [g2.step([9], "!", tr, final=True)]
    assert [i for s in got for i in s.token_ids] == [1, 2, 9]
    assert "".join(s.text for s in got) == "hello there !"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("rules:\n  - {name: a, words: [x], action: drop}\n", r"g\.yaml:2: rule 'a': `action` must be mask or stop"),
        ("rules:\n  - name: a\n    pattern: '('\n    action: mask\n", r"g\.yaml:2: rule 'a': pattern does not com"),
        ("rules:\n- {name: a, pattern: 'x*', action: mask}\n", r"g\.yaml:2: rule 'a': pattern matches the empty"),
        ("rules:\n- {name: a, words: [], action: mask}\n", r"g\.yaml:2: rule 'a': the word list is empty"),
        ("rules:\n- {name: a, words: [x], pattern: y, action: mask}\n", r"exactly one of `pattern`, `words`"),
        ("rules:\n- {name: a, words: [x], action: mask, colour: red}\n", r"g\.yaml:2: rule 'a': unknown field"),
        ("rules:\n- {name: a, words: [x], action: mask, tenants: alice}\n", r"`tenants` must be a non-empty list"),
        ("rules:\n- {name: a, pattern: x, max_match_chars: 0, action: mask}\n", r"`max_match_chars` must be"),
        (
            "rules:\n- {name: a, words: [x], action: mask}\n- {name: a, words: [y], action: stop}\n",
            r":3: rule 'a'.*g\.yaml:2",
        ),
        ("rules:\n- {name: 'a b', words: [x], action: mask}\n", r"`name` must be"),
        ("rules: [\n  {name: a\n", r"g\.yaml:\d+: not valid YAML"),
        ("- just a list\n", r"g\.yaml:1: expected a mapping"),
        (
            "rules:\n- {name: w, words_file: missing.txt, action: mask}\n",
            r"g\.yaml:2: rule 'w': `words_file` must name",
        ),
    ],
)
def test_bad_rule_files_name_the_file_line_and_rule(yaml_text: str, message: str) -> None:
    with pytest.raises(RuleError, match=message):
        rules(yaml_text)


def test_words_file_comments_and_blank_lines() -> None:
    rs = rules(
        "rules:\n- {name: w, words_file: w.txt, action: mask}\n",
        {"w.txt": "# banned\n\n  foo  \nbar   baz\n"},
    )
    assert run(["foo bar  baz bar baz"], rs.for_tenant(""))[0] == "*** bar  baz ***"
    assert rules("rules: []") == RuleSet((), 1)
    with pytest.raises(RuleError, match=r"g\.yaml: empty \(write `rules: \[\]` for no rules\)"):
        rules("")


def test_random_streams_match_a_one_shot_oracle() -> None:
    """Random texts over a small alphabet (many near-matches), random chunkings: the streamed output equals
    the whole-text substitution, for words and a regex."""
    import random

    rnd = random.Random(7)
    tr = rules("rules: [{name: w, words: [ab, abba, 'b a'], action: mask}]").for_tenant("")
    oracle = re.compile(r"(?<!\w)(?:abba|b a|ab)(?!\w)", re.IGNORECASE)
    for _ in range(400):
        text = "".join(rnd.choice("abB .") for _ in range(rnd.randint(0, 30)))
        cuts = sorted(rnd.sample(range(len(text) + 1), min(3, len(text) + 1)))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        want = _union_mask(text, oracle)
        assert run(parts, tr)[0] == want, (text, parts)


def _union_mask(text: str, rx: re.Pattern[str]) -> str:
    """The oracle: every match at every start, spans merged, each merged span one ***."""
    covered = [False] * len(text)
    for s in range(len(text)):
        m = rx.match(text, s)
        for k in range(s, m.end() if m else s):
            covered[k] = True
    out, i = [], 0
    while i < len(text):
        if covered[i]:
            while i < len(text) and covered[i]:
                i += 1
            out.append("***")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
