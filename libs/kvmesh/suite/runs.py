"""A local suite's runs: the state file from the first process on, a directory per run, what `kvmesh up` prints
while it starts and `kvmesh down` while it stops, and `kvmesh logs`.

Under ``$KVMESH_HOME/run`` (`kvmesh.suite.local.run_dir`):

    suite.json     the suite's state (`state_path`): written when `up` starts, with ``"state": "starting"``, the
                   launcher's pid and every service process as it is spawned (``starting``) and as it serves
                   (``services``); ``"state": "running"`` once all serve; removed by `down`
    auth/, pki/    the suite's identities
    current/       this run's state: ``logs/``, ``checkpoints/``, the planner's history, the registry and
                   last-known-good files, redis and Prometheus data
    last/          the previous run's, kept for reading (``kvmesh logs --last``)

`up` opens a fresh ``current/`` (one left by a run that ended without `down` is closed first); `down` closes it
(``current/`` becomes ``last/``, the older ``last/`` goes), so no run's history, logs or checkpoints reach the
next one: a fresh suite's planner plans from its own traffic only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.suite.local import run_dir, state_path

PROGRESS_EVERY_S = 5.0  # a line while services are still starting, at most this often
STOP_TIMEOUT_S = 30.0  # a service's SIGTERM to SIGKILL


def current_dir() -> Path:
    """This run's directory (logs, checkpoints, planner history, registry)."""
    return run_dir() / "current"


def last_dir() -> Path:
    """The previous run's directory, kept for reading."""
    return run_dir() / "last"


def open_run() -> Path:
    """A fresh ``current/`` (a leftover one, of a run that ended without `down`, is closed first)."""
    close_run()
    cur = current_dir()
    cur.mkdir(parents=True)
    return cur


def close_run(state: dict[str, Any] | None = None) -> Path | None:
    """``current/`` becomes ``last/`` (the older ``last/`` removed), with the run's final `state` in it as
    ``suite.json`` for `kvmesh logs --last`; None when no run is open."""
    cur, last = current_dir(), last_dir()
    if not cur.exists():
        return None
    if state is not None:
        (cur / "suite.json").write_text(json.dumps(state, indent=1))
    if last.exists():
        shutil.rmtree(last)
    cur.rename(last)
    return last


def discard_run() -> None:
    """Removes ``current/`` (a start that started nothing: ``last/`` stays the last real run's)."""
    shutil.rmtree(current_dir(), ignore_errors=True)


class Interrupted(Exception):
    """`kvmesh up` was told to stop (SIGTERM, e.g. from `kvmesh down`) while the suite was starting."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _zone_of(args: Sequence[str]) -> str:
    return args[args.index("--zone") + 1] if "--zone" in args[:-1] else ""


def _label(sp: ServiceProcess, args: Sequence[str]) -> str:
    """How a service is named before its ready file gives its id: a worker by its id, others by zone."""
    if "--service-id" in args[:-1]:
        return args[args.index("--service-id") + 1]
    return f"{sp.name}-{_zone_of(args)}" if _zone_of(args) else sp.name


class StartProgress:
    """The `StartWatch` of `kvmesh up`: keeps the state file in step with every service spawned and ready, and
    prints a line per service as it becomes ready and, while some are still starting (vLLM engines loading), a
    progress line every `PROGRESS_EVERY_S`. Called from the threads that start services: one lock for all."""

    def __init__(self, path: Path, run: Path, out: TextIO = sys.stdout, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.out = out
        self.t0 = clock()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._ticker: threading.Thread | None = None
        self._said = self.t0  # when the last line was printed
        self._aborted = False
        self.state: dict[str, Any] = {
            "state": "starting",
            "launcher_pid": os.getpid(),
            "started_at": self.t0,
            "run_dir": str(run),
            "services": [],
            "starting": [],
            "auth": None,
        }
        self._write()

    def _write(self) -> None:
        """Atomically (a reader never sees half a file)."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.path)

    def _say(self, line: str) -> None:
        self._said = self.clock()
        print(line, file=self.out, flush=True)

    def provisioned(self, auth: dict[str, Any]) -> None:
        with self._lock:
            self.state["auth"] = auth
            self._write()

    def spawned(self, sp: ServiceProcess, args: Sequence[str]) -> None:
        engine = args[args.index("--engine") + 1] if "--engine" in args[:-1] else ""
        entry = {
            "name": sp.name,
            "label": _label(sp, args),
            "zone": _zone_of(args),
            "pid": sp.proc.pid,
            "log": str(sp.log_path),
            "since": self.clock(),
            "engine": engine,
        }
        with self._lock:
            self.state["starting"].append(entry)
            self._write()
            aborted = self._aborted
        if aborted:
            _kill_group(sp.proc.pid)
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="up-progress", daemon=True)
            self._ticker.start()

    def ready(self, sp: ServiceProcess) -> None:
        info = sp.info
        entry = {
            "name": sp.name,
            "id": info["id"],
            "pid": sp.proc.pid,
            "grpc": sp.address,
            "http_port": info["http_port"],
            "http_scheme": info.get("http_scheme", "http"),
            "zone": info.get("zone", ""),
            "log": str(sp.log_path),
        }
        with self._lock:
            self.state["starting"] = [s for s in self.state["starting"] if s["pid"] != sp.proc.pid]
            self.state["services"].append(entry)
            self._write()
            took = self.clock() - self.t0
        self._say(f"  ready  {sp.name:<14} {info['id']:<28} grpc {sp.address:<17} ({took:.1f}s)")

    def waiting(self) -> str:
        """The progress line: what is still starting, for how long, and where its log is."""
        with self._lock:
            pending = list(self.state["starting"])
        if not pending:
            return ""
        now = self.clock()
        names = ", ".join(s["label"] for s in pending)
        oldest = min(pending, key=lambda s: s["since"])
        loading = " (vLLM engines loading)" if any(s["engine"] == "vllm" for s in pending) else ""
        return f"  ...    waiting {now - oldest['since']:.0f}s for {names}{loading}; its log: {oldest['log']}"

    def _tick(self) -> None:
        """A progress line once nothing was said for `PROGRESS_EVERY_S` (a quick start prints none)."""
        while not self._done.wait(1.0):  # how often it looks; what it prints is bounded by PROGRESS_EVERY_S
            if self.clock() - self._said < PROGRESS_EVERY_S:
                continue
            line = self.waiting()
            if line:
                self._say(line)

    def abort(self) -> None:
        """Stop starting: every process spawned so far is killed (with its group), and so is any spawned from now
        on, so that the threads waiting for them to serve give up at once."""
        with self._lock:
            self._aborted = True
            pids = [int(s["pid"]) for s in [*self.state["starting"], *self.state["services"]]]
        for pid in pids:
            _kill_group(pid)

    def finish(self, state: dict[str, Any]) -> None:
        """The suite serves: the final state replaces the starting one."""
        self._done.set()
        with self._lock:
            self.state = {**state, "state": "running", "started_at": self.t0}
            self._write()

    def abandon(self) -> None:
        """The start failed or was interrupted (everything started was stopped): no suite, no state file."""
        self._done.set()
        with self._lock:
            self.path.unlink(missing_ok=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # services run in their own session: the group is the service's


T = TypeVar("T")


def start_interruptibly(start: Callable[[], T], progress: StartProgress) -> T:
    """`start()` in a thread while this (the main) thread waits in short steps, so that a SIGTERM or Ctrl-C is
    handled at once (a signal taken by another thread only runs its Python handler when the main thread next
    runs): on `Interrupted` or KeyboardInterrupt the start is aborted (`StartProgress.abort`), its thread joined
    (it stops what it started) and the interruption re-raised; `start`'s own error is re-raised as it is."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = start()
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="suite-start", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)  # short: the main thread runs signal handlers between the steps
    except (Interrupted, KeyboardInterrupt):
        progress.abort()
        thread.join(60.0)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def terminate_on_sigterm() -> Callable[[], None]:
    """SIGTERM raises `Interrupted` in the main thread (while `up` starts the suite, whose start then stops
    everything it started); returns the function that restores the previous handler."""

    def on_term(_signum: int, _frame: Any) -> None:
        raise Interrupted("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _wait_gone(pid: int, timeout_s: float) -> tuple[bool, int | None]:
    """Waits (bounded) for `pid` to end: reaped when it is a child of ours (its exit code then known), else polled
    for existence. (ended, exit code or None)."""
    from kvmesh.suite.observe import gone

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return True, os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # not our child (a detached suite): poll for existence
            if gone(pid):
                return True, None
        time.sleep(0.05)  # poll interval of another process's exit
    return False, None


def stop_pid(pid: int, timeout_s: float = STOP_TIMEOUT_S, group: bool = True) -> tuple[str, int]:
    """SIGTERM, a bounded wait, then SIGKILL (of its process group when `group`: a worker's vLLM engine process
    goes with it). How it ended (``stopped``, ``exited N``, ``already gone`` or ``killed after N s``) and the exit
    code it counts as (0 when unknown: not our child)."""
    try:
        os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process (SIGSTOP, Ctrl-Z) takes its SIGTERM only once resumed
    except ProcessLookupError:
        return "already gone", 0
    ended, code = _wait_gone(pid, timeout_s)
    if ended:
        return ("stopped", 0) if not code else (f"exited {code}", code)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 10.0)
    return f"killed after {timeout_s:.0f}s", 1


def stop_services(entries: Iterable[dict[str, Any]], out: TextIO = sys.stdout, gone_as: str = "already gone") -> int:
    """Stops each service (in the order given), naming it before it waits and saying how it ended after, one line
    a service (`gone_as` for one that had ended already); the worst exit code (0: each stopped on its SIGTERM)."""
    worst = 0
    for s in entries:
        label = s.get("id") or s.get("label") or s["name"]
        t0 = time.monotonic()
        print(f"  stopping {s['name']:<14} {label:<28} pid {s['pid']:<8} ", end="", file=out, flush=True)
        how, code = stop_pid(int(s["pid"])) if alive(int(s["pid"])) else (gone_as, 0)
        worst = max(worst, code)
        print(f"{how} ({time.monotonic() - t0:.1f}s)", file=out, flush=True)
    return worst


# ---- kvmesh logs ------------------------------------------------------------------------------------------


def _run_state(last: bool) -> tuple[dict[str, Any], Path]:
    """The state of the current run (the running suite's) or of the last one, and that run's directory."""
    if last:
        path = last_dir() / "suite.json"
        if not path.exists():
            raise SystemExit(f"kvmesh logs: no earlier run kept ({last_dir()} is absent)")
        return json.loads(path.read_text()), last_dir()
    if not state_path().exists():
        hint = " (kvmesh logs --last: the previous run's)" if last_dir().exists() else ""
        raise SystemExit(f"kvmesh logs: no suite is running{hint}")
    return json.loads(state_path().read_text()), current_dir()


def log_entries(state: dict[str, Any], run: Path, which: str, zone: str) -> list[tuple[str, Path]]:
    """(label, log file) of the services matching `which` (a service name such as ``router``, or an id such as
    ``worker-a-0``; "" = all) and `zone` ("" = all), their logs looked up in `run` (a closed run's moved)."""
    out = []
    for s in [*state.get("services", []), *state.get("starting", [])]:
        label = s.get("id") or s.get("label") or s["name"]
        if which and which not in (s["name"], label, s.get("label")):
            continue
        if zone and s.get("zone") != zone:
            continue
        out.append((label, run / "logs" / Path(s["log"]).name))
    return out


def _tail(path: Path, lines: int) -> str:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 256 * 1024))  # the last lines of a long log, not the whole file
        text = f.read().decode(errors="replace")
    return "".join(text.splitlines(keepends=True)[-lines:]) if lines > 0 else ""


def logs(args: argparse.Namespace) -> int:
    """`kvmesh logs [SERVICE] [--zone Z] [--lines N] [--follow] [--last]`."""
    state, run = _run_state(args.last)
    found = log_entries(state, run, args.service or "", args.zone or "")
    if not found:
        names = sorted({s.get("id") or s.get("label") or s["name"] for s in state.get("services", [])})
        print(
            f"kvmesh logs: no service {args.service!r} in this run (its services: {', '.join(names)})", file=sys.stderr
        )
        return 2
    for label, path in found:
        print(f"==> {label} ({path}) <==")
        print(_tail(path, args.lines) if path.exists() else "(no log)", end="", flush=True)
    if not args.follow or args.last:
        return 0
    offsets = {p: p.stat().st_size if p.exists() else 0 for _, p in found}
    labels = {p: label for label, p in found}
    try:
        while True:
            for p, off in offsets.items():
                if p.exists() and p.stat().st_size > off:
                    with p.open("rb") as f:
                        f.seek(off)
                        chunk = f.read().decode(errors="replace")
                        offsets[p] = f.tell()
                    prefix = f"[{labels[p]}] " if len(found) > 1 else ""
                    for line in chunk.splitlines():
                        print(prefix + line, flush=True)
            time.sleep(0.5)  # the refresh period of `--follow`, as tail -f's
    except KeyboardInterrupt:
        return 0


def add_logs_parser(sub: Any) -> None:
    p = sub.add_parser(
        "logs",
        help="the suite's service logs (this run's; --last: the previous run's)",
        description="Print the last lines of the logs of the running suite's services (all, or those named by "
        "SERVICE: a service such as router or worker, or an id such as worker-local-0).",
    )
    p.add_argument(
        "service", nargs="?", metavar="SERVICE", help="router, worker, cache-manager, failover, planner, or an id"
    )
    p.add_argument("--zone", help="only this zone's services")
    p.add_argument("--lines", "-n", type=int, default=40, help="last lines of each log (default 40)")
    p.add_argument("--follow", "-f", action="store_true", help="then print what they add, until Ctrl-C")
    p.add_argument("--last", action="store_true", help="the previous run's logs (kept by `kvmesh down`)")
    p.set_defaults(func=logs)
