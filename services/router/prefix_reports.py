"""The router's reports of the prompts it routes from its fresh index replica, batched to the cache-manager.

The cache-manager counts its prefix statistics, hit ratio and warming from the queries it sees; a router whose
replica is fresh asks it nothing, so every prompt routed from the replica is reported (`ReportRoutedPrefixes`,
entries of `kvmesh.cachemgr.routed`). `offer` never waits: a full queue drops the entry. `run` sends a batch
as soon as `max_batch` entries wait, else once entries have waited `flush_s` (counted from their arrival or the
previous send, whichever is later); a failed send loses its batch (logged at debug). Each entry is counted
once in `kvmesh_router_prefix_reports_total{outcome}`: sent, dropped (queue full) or failed. Reporting never
affects routing. `max_queue` 0 turns reporting off.

Token ids go with an entry only for the prompt's *held* part, its `hit_blocks` leading blocks that some worker
holds (`hit_blocks` × `block_size` ids, at most `max_tokens`): the cache-manager needs a prefix's tokens only to
warm or replicate it, it can copy only a prefix that a worker holds, and a prompt's unique tail (most of a long
prompt: a document, a new question) is never worth sending. A prefix becomes held on its second routing, when
its first has cached it, so it carries its tokens from then on. They go only when the prefix they name (the
chain hash at `hit_blocks`) has not carried them in the last `tokens_resend_s`: the cache-manager keeps a
prefix's tokens from the first report that has them (`kvmesh.ops.warming.stats.PrefixStats.observe_keys`), and
building 1K ids into every entry of a hot prompt cost the router ~3 % of its CPU per request. The memory is
bounded (`max_remembered`, oldest out) and forgotten on a failed send, so a lost report or a restarted
cache-manager gets the tokens again within `tokens_resend_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from kvmesh.cachemgr.routed import MAX_ROUTED_PREFIXES, MAX_ROUTED_TOKENS
from kvmesh.ops.warming.stats import checkpoint_keys
from kvmesh.replica.media import Hashes
from kvmesh.services.router import metrics as m
from kvmesh.v1 import cache_manager_pb2 as pb

log = logging.getLogger(__name__)
Send = Callable[[pb.ReportRoutedPrefixesRequest], Awaitable[object]]
# blocks, checkpoint hashes, hit blocks, tenant, the prompt's token ids and how many of them to send
Entry = tuple[int, list[int], int, str, "Tokens | None", int]
Tokens = Sequence[int] | npt.NDArray[np.uint32]


class PrefixReports:
    """A bounded queue of report entries and the loop that sends them in batches (see module docstring)."""

    def __init__(
        self,
        send: Send,
        block_size: int,
        max_queue: int = 4096,
        max_batch: int = 256,
        flush_s: float = 0.1,
        max_tokens: int = 16384,
        tokens_resend_s: float = 5.0,
        max_remembered: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.send = send
        self.block_size = block_size
        self.tokens_resend_s = tokens_resend_s
        self.max_remembered = max_remembered
        self._clock = clock
        self._tokens_sent: OrderedDict[int, float] = OrderedDict()  # held prefix's hash -> when its tokens went
        self.max_tokens = min(max_tokens, MAX_ROUTED_TOKENS)  # token ids sent per entry (0: none)
        self.max_queue = max_queue  # 0: reporting off
        self.max_batch = max(1, min(max_batch, MAX_ROUTED_PREFIXES))
        self.flush_s = flush_s
        self.queue: deque[Entry] = deque()  # messages are built by the sender, off the request path
        self._waiting = asyncio.Event()  # an entry waits
        self._full = asyncio.Event()  # a whole batch waits

    def offer(self, hashes: Hashes, hit_blocks: int, tenant: str = "", token_ids: Tokens | None = None) -> None:
        """Queues the entry of one routed prompt (dropped, and counted, when the queue is full); the token ids
        of its held part go with it when due (module docstring; copied when the batch is built, off the
        request path)."""
        if self.max_queue <= 0:
            return
        if len(self.queue) >= self.max_queue:
            m.PREFIX_REPORTS.labels("dropped").inc()
            return
        held = min(hit_blocks, len(hashes))
        n = min(held * self.block_size, self.max_tokens)
        due = token_ids is not None and n > 0 and self._tokens_due(int(hashes[held - 1]))
        self.queue.append((len(hashes), checkpoint_keys(hashes), hit_blocks, tenant, token_ids if due else None, n))
        self._waiting.set()
        if len(self.queue) >= self.max_batch:
            self._full.set()

    def _tokens_due(self, key: int) -> bool:
        """Whether the held prefix ending in `key` carries its tokens now (and then remembers that it did)."""
        now = self._clock()
        last = self._tokens_sent.get(key)
        if last is not None and now - last < self.tokens_resend_s:
            return False
        self._tokens_sent[key] = now
        self._tokens_sent.move_to_end(key)
        if len(self._tokens_sent) > self.max_remembered:
            self._tokens_sent.popitem(last=False)
        return True

    def take(self) -> list[pb.RoutedPrefix]:
        """The oldest entries, at most one batch, removed from the queue."""
        batch = [entry(*self.queue.popleft()) for _ in range(min(self.max_batch, len(self.queue)))]
        if not self.queue:
            self._waiting.clear()
        if len(self.queue) < self.max_batch:
            self._full.clear()
        return batch

    async def flush(self) -> None:
        """Sends one batch now (if any entry waits); a failure loses the batch and is counted."""
        batch = self.take()
        if not batch:
            return
        try:
            await self.send(pb.ReportRoutedPrefixesRequest(prefixes=batch))
        except grpc.aio.AioRpcError as e:
            why = e.code().name
        except Exception as e:  # whatever failed, the loop carries on: the batch is lost and counted
            why = repr(e)
        else:
            m.PREFIX_REPORTS.labels("sent").inc(len(batch))
            return
        log.debug("ReportRoutedPrefixes failed (%d entries lost): %s", len(batch), why)
        self._tokens_sent.clear()  # the tokens it carried may never have arrived
        m.PREFIX_REPORTS.labels("failed").inc(len(batch))

    async def run(self) -> None:
        """Sends batches until cancelled: when one is full, else `flush_s` after an entry arrived."""
        while True:
            await self._waiting.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.flush_s)
            await self.flush()


def entry(
    blocks: int, keys: list[int], hit_blocks: int, tenant: str, tokens: Tokens | None, n_tokens: int
) -> pb.RoutedPrefix:
    """The report entry of a queued prompt (its first `n_tokens` token ids, if it carries them)."""
    if tokens is None:
        ids: list[int] = []
    else:
        ids = tokens[:n_tokens].tolist() if isinstance(tokens, np.ndarray) else list(tokens[:n_tokens])
    return pb.RoutedPrefix(blocks=blocks, checkpoint_hashes=keys, hit_blocks=hit_blocks, tenant=tenant, token_ids=ids)
