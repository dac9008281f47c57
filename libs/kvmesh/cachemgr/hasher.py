"""Index-hash derivation for ingestion, on top of `kvmesh.index.hashing` (the same hashes routers query with).

`chain(parent, tokens, block_size, lora, tenant)` must equal the tail of `compute_block_hashes(prefix +
tokens)` for the prefix whose last block hash is `parent`; the salt is `make_salt(model, lora, tenant)`.
The salt enters only through a chain's root (`kvmesh.index.hashing`): a block chained after `parent` inherits
the parent's model, LoRA and tenant, whatever is passed for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.index import hashing


class IndexHasher:
    """`BlockHasher` for one model; salts per (LoRA adapter, tenant), cached. `tenant` is the default tenant."""

    def __init__(self, model: str, tenant: str | None = None) -> None:
        self.model = model
        self.tenant = tenant
        self._salts: dict[tuple[str | None, str | None], int] = {}

    def salt(self, lora_name: str | None, tenant: str | None = None) -> int:
        """Salt of (model, lora, tenant or the default tenant)."""
        key = (lora_name, tenant if tenant is not None else self.tenant)
        s = self._salts.get(key)
        if s is None:
            s = self._salts[key] = int(hashing.make_salt(self.model, lora=key[0], tenant=key[1]))
        return s

    def chain(
        self,
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        tenant: str | None = None,
    ) -> list[int]:
        """Index hashes of the full blocks of `token_ids`, chained after `parent` (None: first block)."""
        salt = 0 if parent is not None else self.salt(lora_name, tenant)  # a parent carries the salt
        hs = hashing.compute_block_hashes(token_ids, block_size, salt=salt, parent=parent)
        return [int(h) for h in hs]
