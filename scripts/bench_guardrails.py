#!/usr/bin/env python3
"""Cost of the output guardrail matcher (kvmesh.security.guardrails) per streamed chunk.

A word list of N random words (4-12 letters) plus one regex rule, over a text of 20,000 random words streamed in
5-character chunks (about one token's text each). Prints one JSON line:
`{"chunk_chars": 5, "lists": {N: {"compile_ms": ..., "us_per_chunk": ...}}}`.

Usage: scripts/bench_guardrails.py [N ...]   (default 10 1000 10000 100000)
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvmesh.security.guardrails import GuardedText, build_rule_set, parse_rule_file

RULES = """
rules:
  - {name: words, words_file: words.txt, action: mask}
  - {name: key, pattern: "sk-[a-z0-9]{20}", max_match_chars: 23, action: mask}
"""
CHUNK = 5


def one(n: int, rnd: random.Random) -> dict[str, float]:
    def word() -> str:
        return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(4, 12)))

    words = "\n".join(word() for _ in range(n))
    t0 = time.perf_counter()
    rules = build_rule_set(parse_rule_file(RULES, "bench.yaml"), lambda s: words, 64, 1).for_tenant("")
    compile_s = time.perf_counter() - t0
    text = " ".join(word() for _ in range(20000))
    chunks = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)]
    g = GuardedText()
    t0 = time.perf_counter()
    for c in chunks:
        g.feed(c, rules)
    g.feed("", rules, final=True)
    per_chunk = (time.perf_counter() - t0) / len(chunks)
    return {"compile_ms": round(compile_s * 1e3, 1), "us_per_chunk": round(per_chunk * 1e6, 1)}


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or [10, 1000, 10000, 100000]
    rnd = random.Random(1)
    print(json.dumps({"chunk_chars": CHUNK, "lists": {n: one(n, rnd) for n in sizes}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
