#!/usr/bin/env python3
"""Import-boundary check: services → libs → generated code, no I/O or clocks in the pure packages, serving code
apart from the tools, and no import cycle between packages.

Reads every module under libs/kvmesh and services with `ast` (every import, function-level ones included) and
prints each violation as `file:line: module imports X (rule)`; exits 1 on any. A pure module that imports another
kvmesh module is checked through it too (the chain is printed), so an impure helper can't launder an import.
A cycle is reported once per package pair inside it (`cycle: kvmesh.a -> kvmesh.b (file:line imports X)`): the
packages are `kvmesh.<name>` for the library and `kvmesh.services.<name>` for the services.

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
_IO_AND_CLOCKS += ("time", "datetime", "kvmesh.rpc", "kvmesh.core.tasks", "kvmesh.services")
_PURE = ("kvmesh.core.kvevents", "kvmesh.core.errors", "kvmesh.core.generation", "kvmesh.core.sampling")
_PURE += ("kvmesh.index", "kvmesh.routing", "kvmesh.engine.sim", "kvmesh.openai", "kvmesh.discovery.checks")
_PURE += ("kvmesh.security.signing", "kvmesh.security.guardrails", "kvmesh.security.authz")
_PURE += ("kvmesh.ops.warming", "kvmesh.ops.rollout")
# the tools: benchmarks, the fleet simulator, fuzzing. They may import anything; nothing else imports them.
_TOOLS = ("kvmesh.bench", "kvmesh.fleet", "kvmesh.fuzzing")
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
    Rule("serving code never imports a tool", ("kvmesh",), _TOOLS, exempt=_TOOLS),
    # the live router prices pulls from configured or measured figures (kvmesh.routing.dataplane), never from
    # the simulator's hardware model
    Rule(
        "the router prices from figures, not the simulator",
        ("kvmesh.routing", "kvmesh.services.router"),
        ("kvmesh.engine.sim",),
    ),
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


def package_of(module: str) -> str:
    """The package a module counts under for cycles: `kvmesh.<name>` or `kvmesh.services.<name>`."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["services"] else parts[:2])


def package_cycles(tree: Tree) -> list[str]:
    """One `cycle: A -> B (where)` line per package edge inside each strongly connected set of packages."""
    edges: dict[str, dict[str, str]] = {}  # package → imported package → first `file:line imports X`
    for module, module_imports in tree.imports.items():
        source = package_of(module)
        for imp in module_imports:
            target = tree.resolve(imp.target)
            if target is None or (dest := package_of(target)) == source or len(dest.split(".")) < 2:
                continue
            where = f"{tree.files[module].relative_to(tree.root)}:{imp.line} imports {imp.target}"
            edges.setdefault(source, {}).setdefault(dest, where)
    found: list[str] = []
    for component in strongly_connected(edges):
        members = set(component)
        for source in sorted(component):
            for dest, where in sorted(edges.get(source, {}).items()):
                if dest in members:
                    found.append(f"cycle: {source} -> {dest} ({where})")
    return found


def strongly_connected(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every set of two or more packages that import each other in a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = violations(root.resolve()) + package_cycles(Tree(root.resolve()))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
