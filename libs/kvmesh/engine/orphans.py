"""Processes an engine forks end when their parent does.

vLLM runs its engine core (and, on CPU, its model workers) in processes it forks from the worker. A worker
that exits normally stops them; one killed outright (SIGKILL, the kernel's OOM killer) runs no code, and
its engine processes lived on as orphans holding their memory (~1.4 GB for the tiny model's engine core and
worker) and cores, a second set for every restart. `exit_with_parent()` makes every process forked from this
one from then on (and, the hook being inherited, every process those fork) watch its parent: once the parent
is gone (re-parented to init or a subreaper), it kills itself.

A polling thread, not PR_SET_PDEATHSIG: that signal fires when the *thread* that forked the child ends, and
vLLM's engine core is forked from a pool thread of the worker's event loop.
"""

from __future__ import annotations

import os
import signal
import threading
import time

WATCH_INTERVAL_S = 1.0  # how late an orphan notices; one wake-up a second per forked process
_installed = False
_lock = threading.Lock()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)  # the watch's period: no event tells a process its parent died
    os.kill(os.getpid(), signal.SIGKILL)


def _in_child() -> None:
    threading.Thread(target=_watch, args=(os.getppid(),), name="kvmesh-orphan-watch", daemon=True).start()


def exit_with_parent() -> None:
    """From now on, every process forked from this one (see the module docstring) dies with its parent.
    Idempotent. Processes started with exec (subprocess) run no Python fork hook and are not affected."""
    global _installed
    with _lock:
        if not _installed:
            os.register_at_fork(after_in_child=_in_child)
            _installed = True
