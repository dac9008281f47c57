"""Which transport a kv-sync pull tries, in which order (pure: no I/O).

Three transports move a leased block's bytes: `shm` (the peer's region attached on this host, one-sided),
`mooncake` (Mooncake's Transfer Engine: one-sided reads of the peer's registered region across hosts, over
TCP or RDMA) and `grpc` (ReadBlocks streams). The lease (AcquireLease) and the integrity checks are kv-sync's
whichever moves the bytes. `grpc` is always the last resort: a transport that fails to *transfer* (not
offered, cannot connect, a transfer engine error) gives way to the next one, while a failed check (corrupt,
stale, expired) ends the pull.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.core.errors import InvalidArgument

SHM, MOONCAKE, GRPC = "shm", "mooncake", "grpc"
TRANSPORTS = (SHM, MOONCAKE, GRPC)  # best first
CHOICES = ("auto", *TRANSPORTS)  # what a worker's --kvsync-transport accepts
LEGACY_OFFER = (SHM, GRPC)  # what a server that does not list its transports offers


def check_choice(field: str, choice: str) -> str:
    """`choice` if it is one of `CHOICES`, else InvalidArgument naming `field`."""
    if choice not in CHOICES:
        raise InvalidArgument(field, f"must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def exports_mooncake(choice: str, authorised: bool) -> bool:
    """Whether a worker exports its tier through Mooncake's Transfer Engine. TE's reads are one-sided and
    unauthenticated (whoever reaches its ports reads the registered region), so under `auto` a worker that
    enforces its authorisation table does not export; `mooncake` is the operator's word that TE's network is
    fenced off (an RDMA fabric, a private VLAN: docs/security.md), and exports regardless."""
    return choice == MOONCAKE or (choice == "auto" and not authorised)


def offered(choice: str, mooncake_ready: bool) -> list[str]:
    """The transports a server offers under its `choice`: shm and grpc always (any same-host reader may
    attach; grpc is the fallback), mooncake where its transfer engine is up and `choice` is auto or mooncake."""
    check_choice("kvsync_transport", choice)
    with_mooncake = mooncake_ready and choice in ("auto", MOONCAKE)
    return [SHM, MOONCAKE, GRPC] if with_mooncake else [SHM, GRPC]


def transport_order(choice: str, peer_offers: Sequence[str], shm_attaches: bool, mooncake_here: bool) -> list[str]:
    """The transports a pull tries, in order: under `choice` auto, the best that both sides offer (shm when
    the peer's region attaches here, then mooncake when both run a transfer engine), then grpc; under a named
    transport, that one when both sides can use it, then grpc. `peer_offers` empty: an older server
    (`LEGACY_OFFER`)."""
    check_choice("transport", choice)
    offers = set(peer_offers or LEGACY_OFFER)
    usable = {SHM: shm_attaches and SHM in offers, MOONCAKE: mooncake_here and MOONCAKE in offers}
    wanted = TRANSPORTS if choice == "auto" else (choice,)
    return [t for t in wanted if usable.get(t, False)] + [GRPC]
