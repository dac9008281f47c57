"""One load-generating client process of the HTTP router comparison (`--client-processes N`).

    python -m kvmesh.bench.load_client SPEC.json

Where one aiohttp client process is the bottleneck (it parses every response in Python on the same cores), the
comparison's concurrency run is shared by N of these. SPEC names the target's URLs, a JSON file of request
bodies, the request indices this process sends (``first``, ``first + step``, ... below ``stop``: body
``i % len(bodies)`` to URL ``i % len(urls)``, as the in-process client does) and its share of the concurrency.
The process opens its connections with one uncounted request per connection, prints ``ready``, waits for a
line on stdin, sends its requests, and prints one JSON line: ``{"requests": n, "t0": ..., "t1": ...}`` in
CLOCK_MONOTONIC seconds (one clock for every process of the host), so the parent's requests/s is the total over
``max(t1) - min(t0)``. A non-200 answer ends it with exit 1 and the answer on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

READY_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0


def completion_sender(
    session: aiohttp.ClientSession, urls: list[str], bodies: list[Any]
) -> Callable[[int], Awaitable[None]]:
    """Sends request i (body i mod len(bodies)) to urls[i mod len(urls)]; a status other than 200 raises."""

    async def send(i: int) -> None:
        async with session.post(urls[i % len(urls)] + "/v1/completions", json=bodies[i % len(bodies)]) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {body[:300]!r}")

    return send


class ProcessClients:
    """The parent's side: `measure`'s concurrency run for a path, shared by `n` load_client processes (the
    concurrency split as evenly as it goes, request i sent by process i mod n). `targets`: path → URLs;
    `bodies_file`: the JSON list of this size's bodies; `tmp`: a folder for specs and the processes' stderr."""

    def __init__(self, n: int, targets: dict[str, list[str]], bodies_file: Path, tmp: Path) -> None:
        self.n, self.targets, self.bodies_file, self.tmp = n, targets, bodies_file, tmp

    async def __call__(self, name: str, first: int, requests: int, concurrency: int) -> Callable[[], Awaitable[float]]:
        procs = []
        for k in range(self.n):
            spec = {
                "urls": self.targets[name],
                "bodies_file": str(self.bodies_file),
                "first": first + k,
                "stop": first + requests,
                "step": self.n,
                "concurrency": max(1, concurrency // self.n + (1 if k < concurrency % self.n else 0)),
            }
            path = self.tmp / f"load-{name}-{first}-{k}.json"
            path.write_text(json.dumps(spec))
            with open(path.with_suffix(".err"), "wb") as err:
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "kvmesh.bench.load_client",
                        str(path),
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=err,
                    )
                )
        try:
            for k, p in enumerate(procs):
                await self._line(p, k, name, first, READY_TIMEOUT_S, b"ready")
        except BaseException:
            await _stop(procs)
            raise

        async def go() -> float:
            try:
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write(b"go\n")
                await asyncio.gather(*(p.stdin.drain() for p in procs if p.stdin is not None))
                got = [json.loads(await self._line(p, k, name, first, RUN_TIMEOUT_S)) for k, p in enumerate(procs)]
            finally:
                await _stop(procs)
            if sum(g["requests"] for g in got) != requests:
                raise RuntimeError(f"{name}: client processes sent {[g['requests'] for g in got]}, not {requests}")
            return max(g["t1"] for g in got) - min(g["t0"] for g in got)

        return go

    async def _line(
        self, p: asyncio.subprocess.Process, k: int, name: str, first: int, timeout: float, want: bytes = b""
    ) -> bytes:
        assert p.stdout is not None
        line = (await asyncio.wait_for(p.stdout.readline(), timeout)).strip()
        if not line or (want and line != want):
            await p.wait()
            err = (self.tmp / f"load-{name}-{first}-{k}.err").read_text(errors="replace")[-800:]
            raise RuntimeError(f"{name}: client process {k} exited with {p.returncode}: {err}")
        return line


async def _stop(procs: list[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                p.kill()
        await p.wait()


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    urls: list[str] = spec["urls"]
    bodies: list[Any] = json.loads(Path(spec["bodies_file"]).read_text())
    indices = iter(range(spec["first"], spec["stop"], spec["step"]))
    concurrency: int = spec["concurrency"]
    sent = 0
    conn = aiohttp.TCPConnector(limit=4 * concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        send = completion_sender(session, urls, bodies)
        await asyncio.gather(*(send(k) for k in range(concurrency)))  # open the connections, uncounted
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

        async def loop() -> None:
            nonlocal sent
            for i in indices:  # one iterator shared by the loops: each index sent once
                await send(i)
                sent += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        t1 = time.monotonic()
    return {"requests": sent, "t0": t0, "t1": t1}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvmesh.bench.load_client SPEC.json", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_run(json.loads(Path(argv[0]).read_text())))
    except (RuntimeError, aiohttp.ClientError, OSError) as exc:
        print(f"load_client: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
