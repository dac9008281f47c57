"""`kvmesh.bench.router_compare.measure`: the concurrency runs alternate A B, B A so that a drift in the
workers' state lands on every path; every request index is sent once; requests/s is over all rounds."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvmesh.bench.router_compare import measure


async def test_concurrency_runs_alternate_and_send_every_request_once() -> None:
    sent: dict[str, list[int]] = {"a": [], "b": []}
    runs: list[tuple[str, int, int]] = []

    def sender(name: str) -> Callable[[int], Awaitable[None]]:
        async def send(i: int) -> None:
            sent[name].append(i)

        return send

    async def concurrent(name: str, first: int, n: int, conc: int) -> Callable[[], Awaitable[float]]:
        async def go() -> float:
            runs.append((name, first, n))
            for i in range(first, first + n):
                await sender(name)(i)
            return {"a": 0.5, "b": 1.0}[name] * n / 100  # a: 200 requests/s, b: 100

        return go

    out = await measure({"a": sender("a"), "b": sender("b")}, 8, 103, 8, concurrent=concurrent, cc_rounds=5)
    assert [name for name, _, _ in runs] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [n for name, _, n in runs if name == "a"] == [26, 26, 26, 25]
    for name in ("a", "b"):  # warm-up, c1, then the rounds: each index once, in order
        assert sent[name] == list(range(8 + 8 + 103))
    assert out["a"]["c8_rps"] == 200.0 and out["b"]["c8_rps"] == 100.0
    assert "cpu_us_per_request" not in out["a"]


async def test_rounds_hold_at_least_twice_the_concurrency_and_come_in_pairs() -> None:
    runs: list[tuple[str, int]] = []

    async def send(i: int) -> None:
        pass

    async def concurrent(name: str, first: int, n: int, conc: int) -> Callable[[], Awaitable[float]]:
        async def go() -> float:
            runs.append((name, n))
            return 1.0

        return go

    await measure({"a": send, "b": send}, 1, 200, 32, concurrent=concurrent)  # 200 // 64 = 3 -> 2 rounds
    assert runs == [("a", 100), ("b", 100), ("b", 100), ("a", 100)]
    runs.clear()
    await measure({"a": send, "b": send}, 1, 40, 32, concurrent=concurrent)  # too few to split
    assert runs == [("a", 40), ("b", 40)]
