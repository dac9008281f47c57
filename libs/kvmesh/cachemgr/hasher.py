"""Index-hash derivation for ingestion, on top of `kvmesh.hashing` (the same hashes routers query with).

`chain(parent, tokens, block_size, lora)` must equal the tail of `compute_block_hashes(prefix + tokens)`
for the prefix whose last block hash is `parent`; the salt is `make_salt(model, lora, tenant)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh import hashing


class IndexHasher:
    """`BlockHasher` for one model (and tenant), salting per LoRA adapter; salts are cached."""

    def __init__(self, model: str, tenant: str | None = None) -> None:
        self.model = model
        self.tenant = tenant
        self._salts: dict[str | None, int] = {}

    def salt(self, lora_name: str | None) -> int:
        """Salt of (model, lora, tenant)."""
        s = self._salts.get(lora_name)
        if s is None:
            s = self._salts[lora_name] = int(hashing.make_salt(self.model, lora=lora_name, tenant=self.tenant))
        return s

    def chain(
        self, parent: int | None, token_ids: Sequence[int], block_size: int, lora_name: str | None
    ) -> list[int]:
        """Index hashes of the full blocks of `token_ids`, chained after `parent` (None: first block)."""
        hs = hashing.compute_block_hashes(token_ids, block_size, salt=self.salt(lora_name), parent=parent)
        return [int(h) for h in hs]
