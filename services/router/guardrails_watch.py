"""Loads the output guardrail rules from files and reloads them when the files change (the I/O edge of
`kvmesh.security.guardrails`).

`--guardrails PATH`: a YAML rule file, or a directory whose ``*.yaml`` / ``*.yml`` files (sorted, dot files
skipped) are read as one rule list; a rule's ``words_file`` is relative to its YAML file. `poll()` runs every
`--guardrails-reload-s` seconds (the runner's `every`): it compares each file's (mtime_ns, size) and the
directory's listing with the last poll, and reads and hashes the files (SHA-256 of every path and content)
when one differs, or while a file's mtime is within `_RACY_S` of the last poll (a write in the same
timestamp tick keeps mtime and size: the content hash catches it). A new digest is parsed and compiled; good
rules replace the current set (streams use them from their next chunk), bad ones are logged (file, line,
rule) and counted once (a racy re-read of the same bad content is not counted again), and the previous set stays
in force. A bad file at start-up fails the start. `reload()` (the admin RPC `ReloadGuardrails`) reads the files
now whatever their stats say, and raises the bad ones' error instead of logging it; `loaded()` says what is in
force.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.core.errors import InvalidArgument
from kvmesh.security.guardrails import (
    MAX_MATCH_CHARS_LIMIT,
    RuleError,
    RuleSet,
    RuleSpec,
    build_rule_set,
    parse_rule_file,
)
from kvmesh.services.router import metrics as m

log = logging.getLogger(__name__)

_RACY_S = 2.0  # coarser than any file system's timestamp granularity
Stats = dict[str, tuple[int, int]]  # path -> (mtime_ns, size)


@dataclass(frozen=True)
class Loaded:
    """One read of the rule files: the compiled rules, the content digest, the stats before reading."""

    rules: RuleSet
    digest: str
    stats: Stats


class GuardrailsWatch:
    """The rule files under `path`; `apply` receives each new good `RuleSet`."""

    def __init__(self, path: str, default_max_match: int, apply: Callable[[RuleSet], None]) -> None:
        self.path = Path(path)
        self.default_max_match = default_max_match
        self.apply = apply
        self._digest = ""
        self._failed = ""  # the digest and error of the last bad content
        self._stats: Stats = {}
        self._polled = 0.0  # wall time of the last poll (file mtimes are wall times)
        self._version = 0
        self._n_rules = 0
        self._loaded_at = 0.0  # wall time the rules in force were read
        self._lock = asyncio.Lock()  # a poll and a reload never read and accept at the same time

    def load(self) -> RuleSet:
        """The start-up load: InvalidArgument("guardrails", "<file>:<line>: rule ...") when a file is bad."""
        if not 1 <= self.default_max_match <= MAX_MATCH_CHARS_LIMIT:
            raise InvalidArgument("guardrails_max_match_chars", f"must be in [1, {MAX_MATCH_CHARS_LIMIT}]")
        try:
            got = self._read(self._version + 1)
        except (RuleError, OSError) as e:
            raise InvalidArgument("guardrails", str(e)) from None
        self._polled = time.time()
        self._accept(got)
        return got.rules

    def loaded(self) -> tuple[int, int, float]:
        """(rules, version, loaded at: seconds since the epoch) of the set in force."""
        return self._n_rules, self._version, self._loaded_at

    async def reload(self) -> bool:
        """Reads the files now: True when their content changed and the new rules are in force, False when it did
        not; InvalidArgument("guardrails", "<file>:<line>: rule ...") for bad files (the previous set stays)."""
        async with self._lock:
            try:
                got = await asyncio.to_thread(self._read, self._version + 1)
            except (RuleError, OSError) as e:
                m.GUARDRAIL_RELOADS.labels("error").inc()
                log.error("guardrail rules not reloaded, the previous %d stay in force: %s", self._n_rules, e)
                raise InvalidArgument("guardrails", str(e)) from None
            self._polled = time.time()
            if got.digest == self._digest:
                self._stats = got.stats
                return False
            self._accept(got)
            m.GUARDRAIL_RELOADS.labels("ok").inc()
            log.info("guardrail rules reloaded on request: %d rules (version %d)", self._n_rules, self._version)
            return True

    async def poll(self) -> bool:
        """Reloads when the files changed (see the module docstring); True when new rules are in force."""
        async with self._lock:
            return await self._poll()

    async def _poll(self) -> bool:
        now = time.time()
        try:
            got = await asyncio.to_thread(self._changed, now)
        except (RuleError, OSError) as e:
            m.GUARDRAIL_RELOADS.labels("error").inc()
            log.error("guardrail rules not reloaded, the previous %d stay in force: %s", self._n_rules, e)
            return False
        finally:
            self._polled = now
        if got is None:
            return False
        self._accept(got)
        m.GUARDRAIL_RELOADS.labels("ok").inc()
        log.info("guardrail rules reloaded: %d rules (version %d)", len(got.rules.rules), got.rules.version)
        return True

    def _accept(self, got: Loaded) -> None:
        self._digest, self._stats, self._version = got.digest, got.stats, got.rules.version
        self._n_rules = len(got.rules.rules)
        self._loaded_at = time.time()
        m.GUARDRAIL_RULES.set(self._n_rules)
        self.apply(got.rules)

    def _changed(self, now: float) -> Loaded | None:
        """A new load when the files' content changed, else None (a thread: file I/O and regex compiling)."""
        stats = self._stat_all()
        racy = any(mtime / 1e9 >= self._polled - _RACY_S for mtime, _ in stats.values())
        if stats == self._stats and not racy:
            return None
        contents: dict[str, str] = {}
        try:
            got = self._read(self._version + 1, contents)
        except (RuleError, OSError) as e:
            self._stats = stats
            failed = _digest(contents) + str(e)
            if failed == self._failed:  # the same bad content again (a racy re-read): reported once
                return None
            self._failed = failed
            raise
        self._failed = ""
        if got.digest == self._digest:
            self._stats = got.stats
            return None
        return got

    def _yaml_files(self) -> list[Path]:
        if not self.path.is_dir():
            return [self.path]
        found = [p for p in self.path.iterdir() if p.suffix in (".yaml", ".yml") and not p.name.startswith(".")]
        return sorted(found)

    def _words_path(self, spec: RuleSpec) -> Path:
        return Path(spec.source).parent / (spec.words_file or "")

    def _stat_all(self) -> Stats:
        """(mtime_ns, size) of every YAML file and every words file the current rules read."""
        out: Stats = {}
        paths = [*self._yaml_files(), *(Path(p) for p in self._stats)]
        if self.path.is_dir():
            paths.append(self.path)  # its mtime changes when a file is added or removed
        for p in paths:
            try:
                st = p.stat()
                out[str(p)] = (st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                out[str(p)] = (-1, -1)
        return out

    def _read(self, version: int, contents: dict[str, str] | None = None) -> Loaded:
        """Reads (into `contents`: path -> text), hashes and compiles every file; the stats are taken after
        reading (a write while reading has a recent mtime: the next poll is racy and reads again)."""
        yamls = self._yaml_files()
        contents = {} if contents is None else contents
        specs: list[RuleSpec] = []
        for p in yamls:
            contents[str(p)] = _text(p, str(p))
            specs += parse_rule_file(contents[str(p)], str(p))
        for spec in specs:
            wp = self._words_path(spec)
            if spec.words_file is not None and str(wp) not in contents:
                contents[str(wp)] = _text(wp, spec.where)
        stats = self._stat_paths(contents)
        rules = build_rule_set(specs, lambda s: contents.get(str(self._words_path(s))), self.default_max_match, version)
        return Loaded(rules, _digest(contents), stats)

    def _stat_paths(self, contents: dict[str, str]) -> Stats:
        out: Stats = {}
        for p in [*contents, *([str(self.path)] if self.path.is_dir() else [])]:
            st = Path(p).stat()
            out[p] = (st.st_mtime_ns, st.st_size)
        return out


def _text(path: Path, who: str) -> str:
    """A rule or words file's text; RuleError naming `who` when it is missing or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuleError(f"{who}: file {str(path)!r} not found") from None
    except UnicodeDecodeError as e:
        raise RuleError(f"{who}: {str(path)!r} is not UTF-8 ({e.reason} at byte {e.start})") from None


def _digest(contents: dict[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(contents):
        for part in (path, contents[path]):
            b = part.encode()
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()
