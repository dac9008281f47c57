"""The router's guardrail edge: rule files loaded and reloaded on change (real files), and a stream of
chunks filtered (finish reasons, usage, token ids, the inner stream closed on a stop)."""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import PositionLogprobs, TokenLogprob
from kvmesh.security.guardrails import RuleSet, build_rule_set, parse_rule_file
from kvmesh.services.router import metrics as m
from kvmesh.services.router.core import Chunk
from kvmesh.services.router.guarded import OutputGuard
from kvmesh.services.router.guardrails_watch import GuardrailsWatch
from kvmesh.v1 import common_pb2

pytestmark = pytest.mark.unit


def reloads(outcome: str) -> float:
    return m.GUARDRAIL_RELOADS.labels(outcome)._value.get()  # type: ignore[attr-defined, no-any-return]


def watch_of(path: Path) -> tuple[GuardrailsWatch, list[RuleSet]]:
    got: list[RuleSet] = []
    return GuardrailsWatch(str(path), 64, got.append), got


def bump(path: Path, text: str) -> None:
    """Writes `text`, with an mtime unlike the last one (the watcher's stat check is what is tested)."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(old + 10**9, old + 10**9))


async def test_a_changed_words_file_is_reloaded_and_an_unchanged_one_is_not(tmp_path: Path) -> None:
    (tmp_path / "w.txt").write_text("apple\n")
    (tmp_path / "g.yaml").write_text("rules:\n  - {name: fruit, words_file: w.txt, action: mask}\n")
    w, got = watch_of(tmp_path / "g.yaml")
    first = w.load()
    assert [r.name for r in first.rules] == ["fruit"] and first.for_tenant("").hold == 5
    ok = reloads("ok")
    assert await w.poll() is False  # nothing changed (a racy mtime is re-hashed: same digest)
    bump(tmp_path / "w.txt", "apple\nbananas\n")
    assert await w.poll() is True
    assert got[-1].version == 2 and got[-1].for_tenant("").hold == len("bananas")
    assert reloads("ok") == ok + 1


async def test_same_size_same_mtime_edit_is_caught_by_the_content_hash(tmp_path: Path) -> None:
    p = tmp_path / "g.yaml"
    p.write_text("rules: [{name: a, words: [aaaa], action: mask}]\n")
    st = p.stat()
    w, got = watch_of(p)
    w.load()
    p.write_text("rules: [{name: a, words: [bbbb], action: mask}]\n")  # same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only the (racy, recent) hash tells
    assert await w.poll() is True
    assert got[-1].rules[0].regex.search("x bbbb y")


async def test_a_bad_edit_keeps_the_previous_rules_and_is_counted_once(tmp_path: Path) -> None:
    p = tmp_path / "g.yaml"
    p.write_text("rules: [{name: a, words: [aaaa], action: mask}]\n")
    w, got = watch_of(p)
    w.load()
    errors = reloads("error")
    bump(p, "rules:\n  - {name: a, words: [aaaa], action: explode}\n")
    assert await w.poll() is False
    assert reloads("error") == errors + 1 and len(got) == 1  # the previous set stays (apply not called)
    assert await w.poll() is False  # re-read (its mtime is recent), the same bad content: not counted again
    assert reloads("error") == errors + 1 and len(got) == 1
    bump(p, "rules:\n  - {name: a, words: [cccc], action: stop}\n")
    assert await w.poll() is True and got[-1].rules[0].action.value == "stop"


async def test_reload_reads_now_and_raises_a_bad_file_s_error(tmp_path: Path) -> None:
    """`ReloadGuardrails`: the files read whatever their stats say (an edit keeping size and mtime included); a
    bad file is InvalidArgument naming file and rule, the rules in force stay; `loaded` says what is in force."""
    p = tmp_path / "g.yaml"
    p.write_text("rules: [{name: a, words: [aaaa], action: mask}]\n")
    w, got = watch_of(p)
    w.load()
    rules, version, at = w.loaded()
    assert (rules, version) == (1, 1) and at > 0
    assert await w.reload() is False and len(got) == 1  # unchanged content: nothing applied
    st = p.stat()
    p.write_text("rules: [{name: a, words: [aaaa], action: stop}, {name: b, words: [bb], action: mask}]\n")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert await w.reload() is True and got[-1].version == 2 and w.loaded()[:2] == (2, 2)
    errors = reloads("error")
    bump(p, "rules:\n  - {name: a, words: [aaaa], action: explode}\n")
    with pytest.raises(InvalidArgument, match=rf"guardrails: {p}:2: rule 'a': `action` must be mask or stop"):
        await w.reload()
    assert reloads("error") == errors + 1 and len(got) == 2 and w.loaded()[:2] == (2, 2)  # the previous set stays


async def test_deleted_file_is_an_error_and_start_up_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "g.yaml"
    p.write_text("rules: [{name: a, words: [aaaa], action: mask}]\n")
    w, got = watch_of(p)
    w.load()
    p.unlink()
    errors = reloads("error")
    assert await w.poll() is False and reloads("error") == errors + 1 and len(got) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: x\n    pattern: '[unclosed'\n    action: mask\n")
    with pytest.raises(InvalidArgument, match=rf"guardrails: {bad}:2: rule 'x': pattern does not compile"):
        watch_of(bad)[0].load()
    with pytest.raises(InvalidArgument, match=r"guardrails_max_match_chars: must be in \[1, 4096\]"):
        GuardrailsWatch(str(p), 0, lambda rs: None).load()
    missing = tmp_path / "m.yaml"
    missing.write_text("rules: [{name: w, words_file: nope.txt, action: mask}]\n")
    with pytest.raises(InvalidArgument, match=r"m\.yaml:1: rule 'w': file '.*nope\.txt' not found"):
        watch_of(missing)[0].load()


async def test_a_directory_of_rule_files_and_a_file_added_to_it(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("rules: [{name: a, words: [alpha], action: mask}]\n")
    (tmp_path / ".b.yaml.swp").write_text("not yaml: [")
    w, got = watch_of(tmp_path)
    assert [r.name for r in w.load().rules] == ["a"]
    (tmp_path / "b.yml").write_text("rules: [{name: b, pattern: 'x[0-9]', action: stop, tenants: [t1]}]\n")
    os.utime(tmp_path, ns=(tmp_path.stat().st_mtime_ns + 10**9,) * 2)
    assert await w.poll() is True
    assert [r.name for r in got[-1].rules] == ["a", "b"]
    assert [r.name for r in got[-1].for_tenant("t2").rules] == ["a"]


# ---- the stream filter ---------------------------------------------------------------------------------------
def rule_set(yaml_text: str) -> RuleSet:
    return build_rule_set(parse_rule_file(yaml_text, "g.yaml"), lambda s: None, 64, 1)


class Inner:
    """A core stream of one-token chunks; records whether it was closed."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.closed = False

    async def gen(self) -> AsyncGenerator[Chunk, None]:
        try:
            for i, t in enumerate(self.texts):
                last = i == len(self.texts) - 1
                usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=len(self.texts), cached_tokens=3)
                yield Chunk(
                    [100 + i],
                    t,
                    "w1",
                    0,
                    common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    usage if last else None,
                )
        finally:
            self.closed = True


async def collect(guard: OutputGuard, inner: Inner, tenant: str = "") -> list[Chunk]:
    return [c async for c in guard.filter(inner.gen(), "r1", tenant, 7)]


async def test_mask_keeps_the_engines_usage_and_every_token_id() -> None:
    guard = OutputGuard(rule_set("rules: [{name: pw, words: [hunter2], action: mask}]"))
    inner = Inner(["my ", "pass ", "is hun", "ter", "2 ok"])
    before = m.GUARDRAIL_MATCHES.labels("pw", "mask")._value.get()  # type: ignore[attr-defined]
    out = await collect(guard, inner)
    assert "".join(c.text for c in out) == "my pass is *** ok"
    assert [i for c in out for i in c.token_ids] == [100, 101, 102, 103, 104]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == 5 and out[-1].usage.cached_tokens == 3
    assert all(c.text or c.token_ids or c.finish_reason for c in out)  # no empty messages
    assert m.GUARDRAIL_MATCHES.labels("pw", "mask")._value.get() == before + 1  # type: ignore[attr-defined]


async def test_stop_ends_with_content_filter_and_closes_the_worker_stream() -> None:
    guard = OutputGuard(rule_set("rules: [{name: bad, words: [kaboom], action: stop}]"))
    inner = Inner(["all ", "fine ", "ka", "boom", " later", " end"])
    out = await collect(guard, inner)
    assert "".join(c.text for c in out) == "all fine "
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_CONTENT_FILTER
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == 5  # the engine's tokens so far
    assert out[-1].usage.prompt_tokens == 7
    assert [i for c in out for i in c.token_ids] == [100, 101]  # "ka", "boom" and " later" are never sent
    assert inner.closed


async def test_rules_swapped_mid_stream_apply_from_the_next_chunk() -> None:
    guard = OutputGuard(rule_set("rules: [{name: a, words: [apple], action: mask}]"))
    inner = Inner(["an apple, a ", "pear, ", "an apple", " and a pear", "."])
    it = guard.filter(inner.gen(), "r1", "", 7)
    first = await anext(it)
    guard.swap(rule_set("rules: [{name: p, words: [pear], action: mask}]"))
    rest = [c async for c in it]
    assert first.text + "".join(c.text for c in rest) == "an ***, a ***, an apple and a ***."


async def test_per_tenant_streams() -> None:
    guard = OutputGuard(rule_set("rules: [{name: a, words: [apple], action: stop, tenants: [alice]}]"))
    assert "".join(c.text for c in await collect(guard, Inner(["an ", "apple"]), "bob")) == "an apple"
    out = await collect(guard, Inner(["an ", "apple"]), "alice")
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_CONTENT_FILTER and out[-1].text == "an "


def lp(token_id: int) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token_id, -1.0, 1))


async def two_sequences(steps: list[tuple[int, str, bool]]) -> AsyncGenerator[Chunk, None]:
    """Interleaved chunks of a request with n = 2: (index, text, ends its sequence); usage on the last."""
    for i, (index, text, ends) in enumerate(steps):
        last = i == len(steps) - 1
        usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=len(steps)) if last else None
        finish = common_pb2.FINISH_REASON_STOP if ends else common_pb2.FINISH_REASON_UNSPECIFIED
        yield Chunk([200 + i], text, "w1", 0, finish, usage, index, (lp(200 + i),))


async def test_a_stop_in_one_of_n_sequences_ends_that_sequence_only() -> None:
    guard = OutputGuard(rule_set("rules: [{name: bad, words: [kaboom], action: stop}]"))
    steps = [(0, "fine ", False), (1, "also ", False), (0, "kaboom", False), (1, "fine", False)]
    steps += [(0, " dropped", True), (1, ".", True)]
    out = [c async for c in guard.filter(two_sequences(steps), "r1", "", 7, n=2)]
    by_index = {i: [c for c in out if c.index == i] for i in (0, 1)}
    assert "".join(c.text for c in by_index[0]) == "fine "
    assert by_index[0][-1].finish_reason == common_pb2.FINISH_REASON_CONTENT_FILTER
    assert "".join(c.text for c in by_index[1]) == "also fine."
    assert by_index[1][-1].finish_reason == common_pb2.FINISH_REASON_STOP
    # the request's usage comes once, at its end (the engine's, as sequence 1 ran to its finish)
    assert [c.usage.completion_tokens for c in out if c.usage is not None] == [6]
    assert out[-1].usage is not None


async def test_held_back_tokens_keep_their_log_probabilities() -> None:
    guard = OutputGuard(rule_set("rules: [{name: pw, words: [hunter2], action: mask}]"))
    steps = [(0, "my hun", False), (1, "ok", False), (0, "ter2 is", False), (1, "!", True), (0, " out", True)]
    out = [c async for c in guard.filter(two_sequences(steps), "r1", "", 7, n=2)]
    for c in out:  # one log-probability per token id sent, for that very token
        assert [x.token.token_id for x in c.logprobs if x is not None] == c.token_ids
    assert sorted(i for c in out for i in c.token_ids) == [200, 201, 202, 203, 204]
    assert "hunter2" not in "".join(c.text for c in out if c.index == 0)
