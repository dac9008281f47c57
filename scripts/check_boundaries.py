#!/usr/bin/env python3
"""Import-boundary check: services → libs → generated code, and no I/O or clocks in the pure packages.

Reads every module under libs/kvmesh and services with `ast` (every import, function-level ones included) and
prints each violation as `file:line: module imports X (rule)`; exits 1 on any. A pure module that imports another
kvmesh module is checked through it too (the chain is printed), so an impure helper can't launder an import.

Usage: scripts/check_boundaries.py [ROOT]   (ROOT defaults to the repository root)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

# A pattern names a module and everything below it; `*` is a glob; `{service}` is the importing service's name.
_IO_AND_CLOCKS = ("grpc", "asyncio", "socket", "selectors", "ssl", "zmq", "redis", "aiohttp", "httpx", "consul")
_IO_AND_CLOCKS += ("time", "datetime", "kvmesh.rpc", "kvmesh.tasks", "kvmesh.services")
_PURE = ("kvmesh.hashing", "kvmesh.index", "kvmesh.routing", "kvmesh.warming", "kvmesh.engine.sim")
_PURE += ("kvmesh.kvevents", "kvmesh.errors", "kvmesh.openai", "kvmesh.discovery.checks", "kvmesh.security.signing")
_PURE += ("kvmesh.security.guardrails",)
_PURE += ("kvmesh.security.authz",)
_PURE += ("kvmesh.rollout",)
_PURE_CODECS = ("kvmesh.wire.vllm_events", "kvmesh.wire.proto*", "kvmesh.wire.ingest_log")


@dataclass(frozen=True)
class Rule:
    """Modules matching `scope` (minus `exempt`) may not import `forbid`, unless the import matches `allow`."""

    name: str
    scope: tuple[str, ...]
    forbid: tuple[str, ...]
    allow: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    transitive: bool = False  # follow imports of other kvmesh modules


RULES = (
    Rule("libs never import services", ("kvmesh",), ("kvmesh.services",), exempt=("kvmesh.services",)),
    Rule("generated code imports only itself", ("kvmesh.v1",), ("kvmesh",), allow=("kvmesh.v1",)),
    Rule(
        "no service imports another",
        ("kvmesh.services.*",),
        ("kvmesh.services.*",),
        allow=("kvmesh.services.{service}",),
    ),
    Rule(
        "pure: no I/O or clocks",
        _PURE,
        (*_IO_AND_CLOCKS, "kvmesh.v1"),
        # the async driver around the pure model; the aiohttp edge of the OpenAI protocol
        exempt=("kvmesh.engine.sim.driver", "kvmesh.openai.aio"),
        transitive=True,
    ),
    Rule("pure codec: no I/O or clocks", _PURE_CODECS, _IO_AND_CLOCKS, allow=("kvmesh.v1",), transitive=True),
)
SOURCES = (("libs/kvmesh", "kvmesh"), ("services", "kvmesh.services"))
GENERATED = "kvmesh.v1"  # not followed transitively: only a rule's `allow` reaches it


def matches(module: str, pattern: str) -> bool:
    """True when `module` is `pattern` or lies below it."""
    return fnmatchcase(module, pattern) or fnmatchcase(module, pattern + ".*")


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # dotted name: `import a.b` → a.b; `from a import b` → a.b


def module_name(path: Path, root: Path) -> str | None:
    """Dotted module name of a source file, or None outside the checked trees."""
    rel = path.relative_to(root)
    for folder, package in SOURCES:
        base = Path(folder)
        if rel.is_relative_to(base):
            parts = list(rel.relative_to(base).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    return None


def imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[Import]:
    """Every import anywhere in the module, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (Import(node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            yield from (Import(node.lineno, f"{base}.{alias.name}") for alias in node.names)


def parents(module: str) -> Iterator[str]:
    """The module and its packages, whose `__init__` an import runs too."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        yield ".".join(parts[:i])


class Tree:
    """The parsed source trees under a root: module → (file, imports)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, Path] = {}
        self.imports: dict[str, list[Import]] = {}
        for folder, _ in SOURCES:
            for path in sorted((root / folder).rglob("*.py")):
                name = module_name(path, root)
                if name is None:
                    continue
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                self.files[name] = path
                self.imports[name] = list(imports(tree, name, path.name == "__init__.py"))

    def resolve(self, target: str) -> str | None:
        """The kvmesh module an import target loads (`from m import name` may name an attribute of m)."""
        return next((m for m in parents(target) if m in self.files), None)


def _forbidden(rule: Rule, module: str, target: str) -> bool:
    service = module.split(".")[2] if module.startswith("kvmesh.services.") else ""
    if any(matches(target, a.format(service=service)) for a in rule.allow):
        return False
    return any(matches(target, f) for f in rule.forbid)


def _reached(rule: Rule, tree: Tree, module: str, target: str) -> list[str] | None:
    """Chain from `target` to a forbidden import through kvmesh modules, or None."""
    start = tree.resolve(target)
    if start is None or not rule.transitive:
        return None
    seen: set[str] = set()
    stack: list[tuple[str, list[str]]] = [(m, [m]) for m in parents(start) if m in tree.files]
    while stack:
        current, chain = stack.pop()
        if current in seen or matches(current, GENERATED) or in_scope(rule, current):
            continue  # modules in scope are checked on their own
        seen.add(current)
        for imp in tree.imports[current]:
            if _forbidden(rule, module, imp.target):
                return [*chain, imp.target]
            nxt = tree.resolve(imp.target)
            if nxt is not None:
                stack.extend((m, [*chain, m]) for m in parents(nxt) if m in tree.files)
    return None


def in_scope(rule: Rule, module: str) -> bool:
    return any(matches(module, s) for s in rule.scope) and not any(matches(module, e) for e in rule.exempt)


def violations(root: Path) -> list[str]:
    """`file:line: module imports X (rule)` for every boundary crossed under root."""
    tree = Tree(root)
    found: list[str] = []
    for module, module_imports in tree.imports.items():
        where = tree.files[module].relative_to(root)
        for rule in RULES:
            if not in_scope(rule, module):
                continue
            for imp in module_imports:
                if _forbidden(rule, module, imp.target):
                    found.append(f"{where}:{imp.line}: {module} imports {imp.target} ({rule.name})")
                elif (chain := _reached(rule, tree, module, imp.target)) is not None:
                    via = " -> ".join(chain)
                    found.append(f"{where}:{imp.line}: {module} imports {chain[-1]} via {via} ({rule.name})")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = violations(root.resolve())
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
