#!/usr/bin/env python3
"""Writes the authorisation table (`kvmesh.security.authz.markdown()`) into docs/security.md, between the
`<!-- authz-table:begin -->` and `<!-- authz-table:end -->` markers; `--check` exits 1 if the file differs.

Usage: scripts/gen_security_table.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvmesh.security.authz import markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
BEGIN, END = "<!-- authz-table:begin -->\n", "<!-- authz-table:end -->"


def render(text: str) -> str:
    """`text` with the block between the markers replaced by the current table."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: markers {BEGIN.strip()} / {END} not found")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + BEGIN + markdown() + END + tail


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is out of date: run scripts/gen_security_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
