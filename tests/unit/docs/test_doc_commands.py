"""Every command the docs show parses with the code it names (tests/unit/docs/doc_commands.py says how), every
code block is accounted for, and the refusal texts docs/security.md quotes are the code's. The README's quick
start and the operations commands run for real in tests/e2e/test_docs_commands.py."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvmesh.core.errors import PermissionDenied, Unauthenticated
from kvmesh.security import authz
from kvmesh.security.identity import CallerRole, Identity
from tests.unit.docs import doc_commands as dc

pytestmark = pytest.mark.unit

VENV_ON_PATH = "PATH=$PWD/.venv/bin:$PATH"


def test_every_fenced_block_names_its_language() -> None:
    """A fence without a language would hide a command from this test: shell blocks say bash/sh/console/shell,
    the others yaml, python, text, json, ..."""
    untyped = [b.where for doc in dc.docs() for b in dc.blocks(doc) if b.lang == ""]
    assert not untyped, f"fences without a language (```bash, ```console, ```text ...): {untyped}"


def test_every_skip_marker_gives_a_reason_and_marks_a_block() -> None:
    counted: Counter[str] = Counter()
    problems = []
    for doc in dc.docs():
        marked = {b.line: b for b in dc.blocks(doc) if b.skip is not None}
        for line, reason in dc.markers(doc):
            where = f"{doc.relative_to(dc.REPO)}:{line}"
            if not reason:
                problems.append(f"{where}: a doc-test skip marker without a reason: `<!-- doc-test: skip (why) -->`")
            if not any(line < at <= line + 2 for at in marked):
                problems.append(f"{where}: a doc-test skip marker that marks no code block (it goes just before one)")
            counted[reason] += 1
    assert not problems, "\n".join(problems)
    # the blocks that are shown but never run or parsed, visible in the test's output when it fails
    assert sum(counted.values()) == sum(1 for d in dc.docs() for b in dc.blocks(d) if b.skip is not None)


def test_the_docs_show_commands() -> None:
    """The extraction finds what a reader sees: the README's quick start and operations.md's transcripts."""
    found = {(b.doc.name, line) for b, _, line in dc.commands()}
    assert ("README.md", "make run") in found
    assert ("operations.md", "kvmesh workers --json") in found
    assert sum(1 for _ in dc.commands()) > 50


def test_every_documented_command_parses_with_the_code() -> None:
    problems = [f"{f.where}: `{f.command}`: {f.problem.splitlines()[-1]}" for f in dc.findings()]
    assert not problems, "documented commands the code rejects:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("words", "wanted"),
    [
        (["kvmesh", "workers", "--jsn"], "unrecognized arguments: --jsn"),
        (["kvmesh", "up", "--workers", "two"], "invalid int value"),
        (["kvmesh", "stauts"], "invalid choice"),
        ([".venv/bin/python", "-m", "kvmesh.bench", "router", "--workerz", "4"], "unrecognized arguments"),
        (["python", "-m", "kvmesh.bench", "nope"], "usage: python -m kvmesh.bench"),
        (["make", "runn"], "no such Makefile target: runn"),
        (["kvmesh", "up", "--config", "docs/examples/none.yaml"], "no such file"),
        (["scripts/none.sh"], "no such script"),
    ],
)
def test_a_wrong_command_is_caught(words: list[str], wanted: str) -> None:
    assert wanted in (dc.check_words(words) or "")


def test_extraction_handles_prompts_continuations_chains_and_env_prefixes() -> None:
    block = dc.Block(
        dc.REPO / "x.md", 1, "console", [(2, "$ A=1 kvmesh zones \\"), (3, "  --json; echo $?"), (4, "out")]
    )
    assert dc.command_lines(block) == [(2, "A=1 kvmesh zones --json; echo $?")]
    assert dc.simple_commands("A=1 B=2 kvmesh zones --json && curl -s x | jq . # note") == [
        ["kvmesh", "zones", "--json"],
        ["curl", "-s", "x"],
        ["jq", "."],
    ]


def test_bare_python_and_kvmesh_commands_say_the_venv_is_on_path() -> None:
    """`python -m kvmesh...` and bare `kvmesh` only work with the venv first on PATH: a doc that shows them says so."""
    bare = re.compile(r"^(python3? -m kvmesh|kvmesh )")
    docs = {b.doc for b, _, line in dc.commands() for words in [line] if bare.match(words)}
    missing = [str(d.relative_to(dc.REPO)) for d in sorted(docs) if VENV_ON_PATH not in d.read_text(encoding="utf-8")]
    assert not missing, f"these docs show bare `python`/`kvmesh` commands without `{VENV_ON_PATH}`: {missing}"


def test_security_md_quotes_the_codes_refusals() -> None:
    text = (dc.REPO / "docs" / "security.md").read_text(encoding="utf-8")
    method = "/kvmesh.v1.CacheManagerService/FindMatches"
    rule = authz.Policy().grpc_rule(method)
    with pytest.raises(PermissionDenied) as denied:
        authz.decide(rule, Identity(CallerRole.WORKER, "worker-local-0"), method)
    assert str(denied.value.args[0]) in " ".join(text.split()), "security.md's PERMISSION_DENIED example"
    with pytest.raises(Unauthenticated) as anonymous:
        authz.decide(rule, None, method)
    assert str(anonymous.value.args[0]) in " ".join(text.split()), "security.md's UNAUTHENTICATED example"


def test_the_one_zone_example_holds_every_key_the_readme_names() -> None:
    """The README calls docs/examples/kvmesh-one-zone-sim.yaml every key with its default: each key it lists is
    there (`zones`, `router.profile`: as comments, unset by default), and `kvmesh up` accepts the file."""
    import yaml

    from kvmesh.suite import config as suite_config

    path = dc.REPO / "docs" / "examples" / "kvmesh-one-zone-sim.yaml"
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    for key in ["worker.replicas", "worker.engine", "worker.vllmArgs", "model.path", "model.name", "model.blockSize"]:
        section, name = key.split(".")
        assert name in data[section], f"{path.name} lacks {key}"
    for key in ["router.apiKeysFile", "tls.enabled", "auth.mode", "redis.enabled", "ports.auto"]:
        section, name = key.split(".")
        assert name in data[section], f"{path.name} lacks {key}"
    assert "telemetry" in data
    assert "# profile:" in text and "`zones:`" in text
    suite_config.load(path, [], {})
