"""tools/stage-model.sh: split a file here, receive its chunks one transfer at a time there."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "stage-model.sh"


def _sh(cwd, *args, check=True):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=check,
    )


def test_split_and_receive_out_of_order(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=here, check=True)
    data = (
        np.random.default_rng(0)
        .integers(0, 256, 3 * 2**20 + 12345, dtype=np.uint8)
        .tobytes()
    )
    (tmp_path / "model.gguf").write_bytes(data)
    dest = there / "cache" / "model.gguf"
    out = _sh(here, "split", str(tmp_path / "model.gguf"), str(dest), "1").stdout
    assert "4 chunks of 1 MiB" in out
    assert "/.stage/" in (here / ".git" / "info" / "exclude").read_text()
    assert len(_sh(here, "plan").stdout.splitlines()) == 4
    manifest = here / ".stage" / "model" / "MANIFEST"
    assert f"sha256={hashlib.sha256(data).hexdigest()}" in manifest.read_text()

    def transfer(part):  # what one transfer leaves there: the manifest and one chunk
        (there / ".stage" / "model").mkdir(parents=True, exist_ok=True)
        shutil.copy(manifest, there / ".stage" / "model" / "MANIFEST")
        shutil.copy(here / ".stage" / "model" / part, there / ".stage" / "model" / part)
        return _sh(there, "receive").stdout

    assert "next chunk: 01" in transfer("00")
    assert "next chunk: 01" in transfer("02")  # early: waits for 01
    assert "next chunk: 01" in transfer("00")  # repeated: dropped
    assert "next chunk: 03" in transfer("01")  # 01 then the waiting 02
    (there / ".stage" / "model" / "03").write_bytes(b"garbage")
    shutil.copy(manifest, there / ".stage" / "model" / "MANIFEST")
    bad = _sh(there, "receive", check=False)
    assert bad.returncode != 0 and "chunk 03 is corrupt" in bad.stderr
    assert "staged" in transfer("03")
    assert dest.read_bytes() == data and not list(there.glob("cache/*.partial"))
    assert "staged" in _sh(there, "status").stdout
