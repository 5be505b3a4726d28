"""What the server checks before any engine work: the body's media type, and error texts that
carry no native library's internals."""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import AUTH, fake_in_process


@pytest.fixture(scope="module")
def fake():
    s = fake_in_process()
    yield s
    s.stop()


@pytest.mark.parametrize("ctype,status", [
    (None, 200),
    ("application/json", 200),
    ("application/json; charset=utf-8", 200),
    ("application/vnd.api+json", 200),
    ("text/plain", 415),
    ("text/plain; charset=utf-8", 415),
    ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415),
])
def test_bodies_must_be_json(fake, ctype, status):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    headers = {**AUTH, **({"Content-Type": ctype} if ctype else {})}
    r = httpx.post(fake.url + "/v1/completions", content=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    if status == 415:
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_schema_errors_carry_no_native_source_paths(fake):
    pytest.importorskip("xgrammar")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    r = httpx.post(fake.url + "/v1/chat/completions", headers=AUTH, timeout=10, json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": bad})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format.json_schema.schema"
    assert "objectx" in err["message"] and ".cc:" not in err["message"], err
    assert "[" not in err["message"].split("usable:")[1], err     # no "[hh:mm:ss]" either
