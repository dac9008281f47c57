"""An engine's processes end when the process that started them does.

vLLM runs its engine core and its model workers in processes of their own, started from the worker (spawned
on CPU, forked on GPUs). A worker that exits normally stops them; one killed outright (SIGKILL, the kernel's
OOM killer) runs no code, and its engine processes lived on as orphans holding their memory (~1.4 GB for the
tiny model's engine core and model worker) and a share of the cores, a second set for every restart (the
chaos campaign's `leaks.processes`). Two ways in, one watch:

* `exit_with_parent()`, in the worker before it starts vLLM: every process forked from it from then on (and,
  the hook being inherited, every process those fork) watches its parent;
* `watch_parent_in_child()`, vLLM's general plugin (`kvmesh.kvplane.vllm_connector.plugin`, which vLLM runs
  in each process it starts, spawned ones included): in a process that multiprocessing started, the same.

The watch: a thread that polls the parent's pid; once the parent is gone (the process re-parented to init or a
subreaper), it kills its own process. Not PR_SET_PDEATHSIG: that signal fires when the *thread* that started
the child ends, and vLLM starts its engine core from a pool thread of the worker's event loop.
"""

from __future__ import annotations

import multiprocessing
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


def watch_parent() -> None:
    """This process dies once its current parent has gone."""
    threading.Thread(target=_watch, args=(os.getppid(),), name="kvmesh-orphan-watch", daemon=True).start()


def watch_parent_in_child() -> bool:
    """`watch_parent()` in a process multiprocessing started (a vLLM engine core or model worker); nothing in
    any other (the worker itself must outlive whatever launched it). True when watching."""
    if multiprocessing.parent_process() is None:
        return False
    watch_parent()
    return True


def exit_with_parent() -> None:
    """From now on, every process forked from this one (see the module docstring) dies with its parent.
    Idempotent. Processes started with exec (subprocess) run no Python fork hook and are not affected."""
    global _installed
    with _lock:
        if not _installed:
            os.register_at_fork(after_in_child=watch_parent)
            _installed = True
