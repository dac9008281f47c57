"""`kvmesh.bench.router_compare.measure`: the concurrency runs alternate A B, B A so that a drift in the
workers' state lands on every path; every request index is sent once; requests/s is over all rounds; the
machine's CPU per request counts what the path's run burned."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from kvmesh.bench.process_cpu import host_busy_s
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


def _burn(cpu_s: float) -> float:
    """Spins until this process has used `cpu_s` more CPU seconds; returns how many it used."""
    t0 = time.process_time()
    while time.process_time() - t0 < cpu_s:
        sum(range(1000))
    return time.process_time() - t0


def test_the_machine_busy_counter_counts_this_process_s_cpu() -> None:
    before = host_busy_s()
    used = _burn(0.3)
    assert host_busy_s() - before >= used - 0.05  # tick accounting: a few 10 ms ticks of slack, never less


async def test_host_cpu_per_request_is_at_least_what_the_path_burned() -> None:
    burned: dict[str, float] = {}

    async def send(i: int) -> None:
        pass

    async def concurrent(name: str, first: int, n: int, conc: int) -> Callable[[], Awaitable[float]]:
        async def go() -> float:
            burned[name] = burned.get(name, 0.0) + (_burn(0.2) if name == "busy" else 0.0)
            return 1.0

        return go

    out = await measure({"busy": send, "idle": send}, 1, 100, 10, concurrent=concurrent, cc_rounds=2)
    # 100 requests, 2 rounds: at least 0.4 s of this process's CPU over 100 requests = 4,000 µs each
    assert out["busy"]["host_cpu_us_per_request"] >= (burned["busy"] - 0.05) / 100 * 1e6
    assert out["idle"]["host_cpu_us_per_request"] >= 0.0
