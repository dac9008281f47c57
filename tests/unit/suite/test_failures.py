"""`kvmesh.suite.failures.explain`: a failed command's one line and exit code, for the failures the e2e tests do
not force (an HTTP answer, a TLS handshake, a bug)."""

from __future__ import annotations

import io
import ssl
import urllib.error
from email.message import Message

import pytest

from kvmesh.suite.failures import explain

pytestmark = pytest.mark.unit


def test_an_http_refusal_names_status_message_and_the_credential_flags() -> None:
    body = io.BytesIO(b'{"error": {"message": "missing API key", "type": "authentication_error", "code": 401}}')
    err = urllib.error.HTTPError("https://127.0.0.1:8000/v1/completions", 401, "Unauthorized", Message(), body)
    line, code = explain(err)
    assert code == 3 and line.startswith("https://127.0.0.1:8000/v1/completions: HTTP 401: missing API key; ")
    assert "--api-key" in line and "\n" not in line
    plain = urllib.error.HTTPError("http://x/", 500, "Internal Server Error", Message(), io.BytesIO(b"<html>"))
    assert explain(plain) == ("http://x/: HTTP 500: Internal Server Error", 1)


def test_a_tls_handshake_names_the_ca_and_a_bug_its_type() -> None:
    line, code = explain(urllib.error.URLError(ssl.SSLError(1, "CERTIFICATE_VERIFY_FAILED")))
    assert code == 4 and line.startswith("TLS: ") and "CA" in line
    assert explain(ZeroDivisionError("division by zero")) == ("unexpected ZeroDivisionError: division by zero", 1)
