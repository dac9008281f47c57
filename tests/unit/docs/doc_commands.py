"""The shell commands the docs show (README.md, docs/**/*.md), extracted as a reader would type them, and checked
against the code: `kvmesh` commands with the CLI's own parser, `python -m kvmesh.bench NAME` with that bench's,
`make` targets with the Makefile, `scripts/...` and repository paths with the tree.

A code block is a fence (``` + language) or a 4-space indented block. Fences must name a language: shell ones
(bash, sh, shell, console) hold commands, the others (yaml, python, text, ...) hold none. An indented block's
commands are its lines that start like one (`python -m`, `kvmesh`, `.venv/bin/...`, `make`, `scripts/`). A block
not meant to run is marked just before it, visibly: `<!-- doc-test: skip (the reason) -->`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[3]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\b\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
_FENCE = re.compile(r"^(?P<indent> {0,3})```(?P<lang>[\w+-]*)\s*$")
_COMMAND_START = re.compile(r"^(\.venv/bin/|python3? -m |kvmesh |make |scripts/|[A-Z_][A-Z0-9_]*=\S* )")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # N, PATH, DIR, KEY: a value the reader fills in
_REPO_PATH = re.compile(r"^(docs|deploy|scripts|libs|services|protos|tests)/[\w./*-]+$")
_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the fence (or of the indented block's first line)
    lang: str  # "" for a fence without one; "indented" for an indented block
    body: list[tuple[int, str]] = field(default_factory=list)
    skip: str | None = None  # the marker's reason ("" when the marker gives none); None: no marker

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every code block of a markdown file, with the skip marker just before it (blank lines between allowed)."""
    out: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    current: Block | None = None
    prev_blank = True
    in_list = False
    for number, text in enumerate(lines, 1):
        if current is not None and current.lang != "indented":
            if _FENCE.match(text) and not _FENCE.match(text).group("lang"):  # type: ignore[union-attr]
                out.append(current)
                current = None
            else:
                current.body.append((number, text))
            continue
        fence = _FENCE.match(text)
        indented = text.startswith("    ") and text.strip()
        if current is not None and current.lang == "indented":
            if indented or not text.strip():
                current.body.append((number, text[4:]))
                continue
            out.append(current)
            current = None
        if fence:
            current = Block(doc, number, fence.group("lang"), skip=_marker(lines, number - 1))
        elif indented and prev_blank and not in_list:
            current = Block(doc, number, "indented", [(number, text[4:])], skip=_marker(lines, number - 1))
        if text.strip():
            # an indented line after a list item continues the item, it is no code block
            in_list = bool(re.match(r"^\s*([-*+]|\d+\.)\s", text)) or (in_list and text.startswith(" "))
        prev_blank = not text.strip()
    if current is not None:
        out.append(current)
    return out


def _marker(lines: list[str], index: int) -> str | None:
    """The reason of a skip marker on the last non-blank line before line `index` (0-based), or None."""
    i = index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    found = SKIP.search(lines[i]) if i >= 0 else None
    return None if found is None else (found.group("reason") or "").strip()


def markers(doc: Path) -> list[tuple[int, str]]:
    """Every skip marker of a file: (line, reason)."""
    return [
        (n, (m.group("reason") or "").strip())
        for n, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if (m := SKIP.search(text))
    ]


def command_lines(block: Block) -> list[tuple[int, str]]:
    """The block's commands as one line each (continuations joined): a console block's `$ ` lines, every line of
    a shell block, an indented block's lines that start like a command."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in block.body:
        text = raw.rstrip()
        if pending is not None:
            start, so_far = pending
            if text.endswith("\\"):
                pending = (start, so_far + " " + text[:-1].strip())
            else:
                out.append((start, so_far + " " + text.strip()))
                pending = None
            continue
        if block.lang == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        elif block.lang == "indented" and not _COMMAND_START.match(text):
            continue
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if text.endswith("\\"):
            pending = (number, text[:-1].strip())
        else:
            out.append((number, text.strip()))
    if pending is not None:
        out.append(pending)
    return out


def simple_commands(line: str) -> list[list[str]]:
    """One line's simple commands (split at `&&`, `||`, `;`, `|`), comments dropped, env-var prefixes removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in _OPERATORS:
            out.append([])
        else:
            out[-1].append(token)
    result = []
    for words in out:
        while words and _ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words:
            result.append(words)
    return result


def _fill(words: list[str]) -> list[str]:
    """Placeholders as a value of every type (`N` -> 1) and `[--optional flag]` as given."""
    out = []
    for word in words:
        word = word.strip("[]")
        if word in ("", "...", "…"):
            continue
        out.append("1" if _PLACEHOLDER.match(word) else word)
    return out


def _argparse_error(call: object) -> str | None:
    """Run a parse; None when argparse accepted it (or printed help), its error text when it exited non-zero."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            call()  # type: ignore[operator]
        except SystemExit as exc:
            return None if exc.code in (0, None) else (err.getvalue().strip() or f"exit {exc.code}")
        except _Parsed:
            return None
    return None


class _Parsed(Exception):
    """Raised right after a bench's parser accepted its arguments, so that nothing of the bench runs."""


def kvmesh_error(args: list[str]) -> str | None:
    """`kvmesh ARGS` checked by the CLI's parser (`bench NAME ...` by that bench's); None when it parses."""
    from kvmesh.suite.cli import build_parser

    if args[:1] == ["bench"]:
        return bench_error(args[1:])
    return _argparse_error(lambda: build_parser().parse_args(_fill(args)))


def bench_error(args: list[str]) -> str | None:
    """`python -m kvmesh.bench ARGS` checked by the dispatcher and that bench's own argparse parser, stopped as soon
    as it has parsed (argparse's parse_args wrapped to raise): no benchmark runs."""
    from kvmesh.bench.__main__ import main as bench_main

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: object, **kw: object) -> argparse.Namespace:
        original(self, *a, **kw)  # type: ignore[arg-type]
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = bench_main(_fill(args))
            except _Parsed:
                return None
            except SystemExit as exc:
                code = 0 if exc.code is None else exc.code  # type: ignore[assignment]
        return None if code == 0 else (err.getvalue().strip() or f"exit {code}")


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, flags=re.MULTILINE))


@dataclass
class Finding:
    where: str
    command: str
    problem: str


def check_words(words: list[str]) -> str | None:
    """One simple command checked against the code; None when it holds (or is not kvmesh's to check)."""
    head, rest = words[0], words[1:]
    for word in rest:
        path = word.split("=", 1)[-1]
        if _REPO_PATH.match(path) and not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            return f"no such file in the repository: {path}"
    if head == "kvmesh" or head.endswith("/kvmesh"):
        return kvmesh_error(rest)
    if re.fullmatch(r"(\S*/)?python3?", head):
        if rest[:2] in (["-m", "kvmesh"], ["-m", "kvmesh.suite.cli"]):
            return kvmesh_error(rest[2:])
        if rest[:2] == ["-m", "kvmesh.bench"]:
            return bench_error(rest[2:])
        if rest and rest[0].startswith("scripts/") and not (REPO / rest[0]).is_file():
            return f"no such script: {rest[0]}"
        return None
    if head == "make":
        missing = sorted({t for t in rest if not t.startswith("-") and "=" not in t} - _make_targets())
        return f"no such Makefile target: {', '.join(missing)}" if missing else None
    if head.startswith("scripts/"):
        script = REPO / head
        if not script.is_file():
            return f"no such script: {head}"
        if not script.stat().st_mode & 0o111:
            return f"not executable: {head}"
    return None


def commands() -> Iterator[tuple[Block, int, str]]:
    """(block, line, command line) of every shell block that is not marked skip."""
    for doc in docs():
        for block in blocks(doc):
            if block.skip is None and (block.lang in SHELL_LANGS or block.lang == "indented"):
                for number, line in command_lines(block):
                    yield block, number, line


def findings() -> list[Finding]:
    out = []
    for block, number, line in commands():
        where = f"{block.doc.relative_to(REPO)}:{number}"
        try:
            words_list = simple_commands(line)
        except ValueError as err:  # unbalanced quotes: the reader could not paste it either
            out.append(Finding(where, line, f"not a shell command: {err}"))
            continue
        for words in words_list:
            problem = check_words(words)
            if problem:
                out.append(Finding(where, line, problem))
    return out
