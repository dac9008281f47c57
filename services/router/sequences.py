"""A request's `n` sequences in the router: one attempt runs them all on one worker (they share the prompt's
KV there), each sequence's tokens tracked apart (`Sequences`); when that attempt fails mid-stream, each
unfinished sequence resumes on its own (`resume_sequences`).

A resumed sequence is a request of its own, `n = 1`, from prompt + that sequence's tokens so far (as the
client's `resume_token_ids` would be), routed on its own prefix and run by the same request path (retries,
migrations, stall watch; the migrations already used count against it), its chunks mapped back to its
index. The resumed requests run concurrently; the merged stream's last chunk carries the usage of every
sequence (the tokens before the failure and those after). The prompt's log-probabilities were sent with the
first attempt, so a resumed sequence does not ask for them again.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping

from kvmesh.services.router.chunks import Chunk
from kvmesh.services.router.request import RouterRequest
from kvmesh.v1 import common_pb2

Run = Callable[[RouterRequest, float, int], AsyncIterator[Chunk]]  # the request path: (request, started, migrations)


class Sequences:
    """The tokens of each of a request's `n` sequences so far and which have finished (n = 1: only the
    finish, the request's own tokens are the attempts' tokens)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: defaultdict[int, list[int]] = defaultdict(list)
        self.finished: set[int] = set()

    def add(self, index: int, token_ids: Iterable[int]) -> None:
        if self.n > 1:
            self.tokens[index].extend(token_ids)

    def finish(self, index: int) -> bool:
        """Sequence `index` finished; whether every sequence has."""
        self.finished.add(index)
        return len(self.finished) >= self.n

    def unfinished(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.finished]


async def resume_sequences(
    run: Run, started: float, req: RouterRequest, seqs: Sequences, generated: int, migrations: int
) -> AsyncIterator[Chunk]:
    """Each unfinished sequence of `req` resumed as its own request (see the module docstring), merged into
    one stream; `generated`: the tokens of every sequence before the failure (usage counts them)."""
    left = seqs.unfinished()
    streams = {i: run(req.sequence(i, seqs.tokens[i]), started, migrations) for i in left}
    completion, cached = generated, 0
    async for i, c in merge_streams(streams):
        c.index = i
        if c.usage is not None:  # sequence i's last chunk
            completion += c.usage.completion_tokens
            cached = max(cached, c.usage.cached_tokens)
            left.remove(i)
            c.usage = None
            if not left:
                c.usage = common_pb2.Usage(
                    prompt_tokens=len(req.prompt), cached_tokens=cached, completion_tokens=completion
                )
        yield c


async def merge_streams(streams: Mapping[int, AsyncIterator[Chunk]]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """The streams' chunks as they come, each with its key; the first error fails the merge and closing it
    (or an error) cancels the streams still running (their worker calls with them)."""
    queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for c in stream:
                queue.put_nowait((i, c))
            queue.put_nowait((i, None))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in streams.items()]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
