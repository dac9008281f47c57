"""Security inputs at their edges: the messages that name a bad entry of a keys or tokens file, how a keys
file's format is told, the SPIFFE id's shape, a development PKI's leaf certificates (never CAs), and a guarded
stream after it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from kvmesh.security.admin import typed_fields
from kvmesh.security.authz import GRPC_RULES, HTTP_RULES, markdown
from kvmesh.security.certs import make_dev_pki
from kvmesh.security.client_keys import ClientKey, ClientKeys, is_yaml_keys_file, parse_entry, parse_keys_text
from kvmesh.security.guardrails import GuardedTokens, RuleError, RuleSet, build_rule_set, parse_rule_file, parse_words
from kvmesh.security.identity import CallerRole, Identity, parse_spiffe_id
from kvmesh.security.tokens import TokenTable, provision, read_own_token

pytestmark = pytest.mark.unit


# --- client keys files


@pytest.mark.parametrize(
    "entry",
    [{"key": "k", "tenants": 3}, {"certificate": "spiffe://kvmesh/-/client/c1", "tenants": [1]}],
    ids=["key", "certificate"],
)
def test_bad_tenants_name_the_entry(entry: dict[str, object]) -> None:
    with pytest.raises(ValueError) as e:
        parse_entry(2, entry)
    assert str(e.value) == "keys[2].tenants: must be a string or a list of strings"


def test_an_optional_string_of_another_type_is_named_without_non_empty() -> None:
    with pytest.raises(ValueError) as e:
        parse_entry(0, {"key": "k", "id": 5})
    assert str(e.value) == "keys[0].id: must be a string"
    with pytest.raises(ValueError) as e:
        parse_entry(0, {"key": ""})
    assert str(e.value) == "keys[0].key: must be a non-empty string"


def test_a_plain_keys_file_skips_blank_lines_and_comments() -> None:
    keys = parse_keys_text("alpha\n\n  # a comment\n   \nbeta  \n", yaml_format=False)
    assert [k.key for k in keys] == ["alpha", "beta"]


def test_a_yaml_keys_file_may_wrap_its_list_in_keys() -> None:
    wrapped = parse_keys_text("keys:\n  - {key: k1, tenants: [t]}\n", yaml_format=True)
    assert [(k.key, k.tenants) for k in wrapped] == [("k1", ("t",))]
    assert parse_keys_text("", yaml_format=True) == []


@pytest.mark.parametrize("text", ["just-a-string\n", "other: [1]\n", "keys: [1]\nmore: 2\n"])
def test_a_yaml_keys_file_that_is_not_a_list_is_refused_saying_what_it_wants(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_keys_text(text, yaml_format=True)
    assert str(e.value) == "keys file: want a YAML list of entries (or {keys: [...]})"


@pytest.mark.parametrize(
    ("path", "text", "yaml"),
    [
        ("keys.txt", "", False),
        ("keys.txt", "# only a comment\n\n", False),
        ("keys.txt", "# c\n- key: k\n", True),
        ("keys.txt", "keys:\n  - key: k\n", True),
        ("keys.txt", "plain-key\n- not-first\n", False),
        ("keys.yml", "", True),
    ],
)
def test_the_keys_file_format_is_told_by_name_or_first_entry(path: str, text: str, yaml: bool) -> None:
    assert is_yaml_keys_file(path, text) is yaml


def test_a_missing_and_an_unknown_key_are_told_apart() -> None:
    keys = ClientKeys([ClientKey.plain("k")])
    for presented, message in ((None, "missing API key"), ("", "missing API key"), ("x", "unknown API key")):
        with pytest.raises(Unauthenticated) as e:
            keys.lookup(presented)
        assert e.value.message == message
    assert ClientKeys([]).lookup(None) is None


# --- service tokens


def test_a_token_entry_without_identity_is_refused_naming_the_empty_id(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens:\n  - {token: secret}\n")
    with pytest.raises(FailedPrecondition) as e:
        TokenTable.load(str(path))
    assert e.value.message.startswith(f"auth_tokens_file {str(path)!r}: tokens[0]: not a kvmesh SPIFFE id")
    assert e.value.message.endswith(": ''")


def test_an_unreadable_own_token_names_the_file_and_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "none.token"
    with pytest.raises(FailedPrecondition) as e:
        read_own_token(str(missing))
    assert e.value.message == f"cannot read auth_token_file {str(missing)!r}: No such file or directory"


def test_tokens_are_provisioned_into_a_directory_not_yet_there(tmp_path: Path) -> None:
    ident = Identity(CallerRole.WORKER, "w1")
    own = provision(tmp_path / "a" / "b", [ident])
    assert own[ident].parent == tmp_path / "a" / "b"
    table = TokenTable.load(str(tmp_path / "a" / "b" / "tokens.yaml"))
    assert table.identity(read_own_token(str(own[ident]))) == ident


# --- identities


@pytest.mark.parametrize("uri", ["spiffe://kvmesh/z/worker", "spiffe://kvmesh/z//w", "spiffe://kvmesh/z/worker/w/x"])
def test_a_spiffe_id_of_the_wrong_shape_is_refused_naming_the_shape(uri: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_spiffe_id(uri)
    assert str(e.value) == f"want spiffe://kvmesh/<zone>/<role>/<id>, got {uri!r}"


# --- the development PKI


def test_dev_pki_leaves_are_not_cas_and_the_directory_may_exist(tmp_path: Path) -> None:
    ident = Identity(CallerRole.ROUTER, "r1")
    pki = make_dev_pki(tmp_path, [ident])  # tmp_path exists already
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = x509.load_pem_x509_certificate(pki.pairs[ident].cert.read_bytes())
    constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False  # a leaf can never sign certificates
    make_dev_pki(tmp_path, [ident])  # regenerating into the same directory works


# --- admin bodies


def test_a_field_of_the_wrong_type_names_the_type_given() -> None:
    with pytest.raises(InvalidArgument) as e:
        typed_fields({"n": "3"}, {"n": int})
    assert e.value.field == "n" and e.value.message == "n: must be an integer, got str '3'"


# --- a guarded stream


def test_a_stopped_stream_sends_nothing_more_and_a_mask_reports_its_rule() -> None:
    specs = parse_rule_file(
        "rules:\n- {name: m, words: [secret], action: mask}\n- {name: s, words: [halt], action: stop}\n", "g.yaml"
    )
    tr = build_rule_set(specs, lambda s: None, 64, 1).for_tenant("")
    g = GuardedTokens()
    first = g.step([1], "a secret ", tr)
    second = g.step([2], "then halt", tr, final=True)
    assert [m.rule.name for m in (*first.matches, *second.matches) if m.rule.name == "m"] == ["m"]
    assert second.stopped is not None and second.stopped.name == "s"
    after = g.step([3], "more", tr, final=True)
    assert (after.text, after.token_ids, after.matches, after.stopped) == ("", [], (), None)


# --- guardrail rule files: each bad field named, the bounds of max_match_chars, where a rule came from


def _rule_set(yaml_text: str) -> RuleSet:
    return build_rule_set(parse_rule_file(yaml_text, "g.yaml"), lambda s: None, 64, 1)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{name: a, pattern: 5, action: mask}", "g.yaml:2: rule 'a': `pattern` must be a string"),
        (
            "{name: a, words: [x], max_match_chars: 3, action: mask}",
            "g.yaml:2: rule 'a': `max_match_chars` is for `pattern` rules (a word list's is its longest word)",
        ),
        ("{name: a, words: abc, action: mask}", "g.yaml:2: rule 'a': `words` must be a list of strings"),
        ("{name: a, words: [x, 3], action: mask}", "g.yaml:2: rule 'a': `words` must be a list of strings"),
        (
            "{name: a, words: [" + "w" * 257 + "], action: mask}",
            "g.yaml:2: rule 'a': a word is longer than 256 characters",
        ),
    ],
    ids=["pattern-not-a-string", "max-match-chars-on-words", "words-not-a-list", "words-not-strings", "word-too-long"],
)
def test_a_bad_rule_field_is_named_with_the_rule(rule: str, message: str) -> None:
    with pytest.raises(RuleError) as e:
        _rule_set(f"rules:\n- {rule}\n")
    assert str(e.value) == message


@pytest.mark.parametrize("reach", [1, 4096])
def test_max_match_chars_takes_1_to_4096(reach: int) -> None:
    (rule,) = _rule_set(f"rules:\n- {{name: a, pattern: x, max_match_chars: {reach}, action: mask}}\n").rules
    assert rule.reach == reach and rule.source == "g.yaml:2"


# --- the authorisation table as the docs show it


def test_the_markdown_table_has_every_grpc_method_and_every_http_route() -> None:
    table = markdown()
    for method in GRPC_RULES:
        assert f"| `{method}` |" in table
    for svc, verb, path in HTTP_RULES:
        assert f"| `{verb} {path} ({svc})` |" in table
    assert table.index("gRPC method") < table.index("HTTP route (service)")


def test_a_words_file_skips_blank_lines_and_comment_lines() -> None:
    assert parse_words("# banned\n\n  foo  \n   # indented comment\nbar   baz\n#\n") == ["foo", "bar   baz"]
