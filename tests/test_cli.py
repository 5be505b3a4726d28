"""The commands' user errors: one line, non-zero exit, found before any model loads; ``--debug``
shows the traceback; ``--help`` shows defaults; eval and calibrate write to default places."""

import json
import socket

import pytest
import torch

import doublesparse.engine
from doublesparse import cli
from doublesparse.cli_common import UsageError
from doublesparse.channels import META_KEY


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    """Every check here must fire before a model loads: building one fails the test."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(doublesparse.engine, "Engine", refuse)
    monkeypatch.setattr("doublesparse.engine.engine.Engine", refuse)
    monkeypatch.setattr("doublesparse.api.Engine", refuse)
    monkeypatch.setattr("doublesparse.models.load_model", refuse)


def one_line_error(capsys, argv, rc=2, match=()):
    assert cli.main(argv) == rc
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"doublesparse {argv[0]}: error: "), err
    for m in (match,) if isinstance(match, str) else match:
        assert m in err, err
    return err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (d / "bad.gguf").write_bytes(b"GGUF" + bytes(range(7, 200)))
    (d / "notgguf.gguf").write_text("hello")
    (d / "bad.json").write_text("{not json")
    return d


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--model-path", "/nonexistent/m"],
            ("--model-path /nonexistent/m", "does not exist"),
        ),
        (["--model-path", "{d}/model.safetensors"], ("single file", "pass the folder")),
        (["--model-path", "{d}/notgguf.gguf"], ("not a GGUF file", "expected a .gguf")),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--top-p", "0"], "--top-p"),
        (
            ["--ds-channel-config-path", "/nonexistent.json"],
            ("--ds-channel-config-path", "no such file"),
        ),
        (["--ds-channel-config-path", "{d}/bad.json"], "not a readable JSON file"),
        (["--max-total-tokens", "-3"], "--max-total-tokens must be an integer >= 1"),
        (["--ds-heavy-token-ratio", "2"], "--ds-heavy-token-ratio must be in (0, 1]"),
        (["--device", "tpu:0"], "--device 'tpu:0'"),
        (["--cpu-threads", "0"], "--cpu-threads must be an integer >= 1"),
        (["--max-new-tokens", "x"], ("argument --max-new-tokens", "--help")),
    ],
)
def test_generate_errors_before_load(capsys, files, argv, match):
    one_line_error(
        capsys, ["generate", *[a.format(d=files) for a in argv]], match=match
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "cmd", ["generate", "serve", "eval", "calibrate", "bench-one-batch"]
)
def test_cuda_without_cuda(capsys, cmd):
    one_line_error(
        capsys, [cmd, "--device", "cuda"], match=("--device cuda", "--device cpu")
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["serve", "--model-path", "/nonexistent"], "--model-path /nonexistent"),
        (
            ["serve", "--ds-channel-config-path", "/nonexistent.json"],
            "--ds-channel-config-path",
        ),
        (["serve", "--port", "70000"], "--port must be in 0..65535"),
        (
            ["serve", "--graceful-shutdown-timeout", "nan"],
            "--graceful-shutdown-timeout",
        ),
        (["eval", "--channels", "/nonexistent.json"], "--channels /nonexistent.json"),
        (["eval", "--retrieval-depths", "1.5"], "must be in [0, 1]"),
        (["eval", "--text", "/nonexistent.txt"], "--text /nonexistent.txt"),
        (["calibrate", "--model-path", "{d}/bad.json"], "--model-path"),
        (["calibrate", "--num-samples", "0"], "--num-samples"),
        (["calibrate", "--output", "{d}"], "a folder"),
        (["bench-one-batch", "--input-len", "0"], "--input-len 0"),
        (
            ["bench-one-batch", "--model-path", "nope", "--load-format", "dummy"],
            "no config for dummy",
        ),
    ],
)
def test_other_commands_errors_before_load(capsys, files, argv, match):
    one_line_error(capsys, [a.format(d=files) for a in argv], match=match)


def test_busy_port_is_reported_before_load(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(
            capsys, ["serve", "--port", str(port)], match=(f"--port {port}", "in use")
        )


def test_debug_shows_the_traceback():
    with pytest.raises(UsageError, match="does not exist"):
        cli.main(["generate", "--model-path", "/nonexistent/m", "--debug"])


def test_damaged_gguf_found_at_load_is_one_line(capsys, files, monkeypatch):
    monkeypatch.undo()  # this one reaches the loader: the file's header is read there
    err = one_line_error(capsys, ["generate", "--model-path", str(files / "bad.gguf")])
    assert "bad.gguf" in err and "download the file again" in err and "--debug" in err


@pytest.mark.parametrize(
    ("cmd", "shown"),
    [
        ("generate", ["--max-new-tokensMAX_NEW_TOKENSdefault:128", "(default:on)"]),
        ("serve", ["(default:30000)", "(default:127.0.0.1)", "(default:on)"]),
        ("eval", ["./doublesparse-eval/<date>-<time>", "(default:cpu)"]),
        (
            "calibrate",
            ["./doublesparse-calibrate/<model>-<date>-<time>.json", "(default:12)"],
        ),
        (
            "bench-one-batch",
            ["--batch-sizeBATCH_SIZE[BATCH_SIZE...]default:1", "(default:off)"],
        ),
    ],
)
def test_help_shows_defaults(capsys, cmd, shown):
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--help"])
    assert e.value.code == 0
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for s in shown:
        assert s in out, (s, out)


def test_eval_default_output_and_report(capsys, tmp_path, monkeypatch):
    from doublesparse.eval import cli as eval_cli

    def fake_run(args):
        for n in ("results.json", "table.md"):
            (tmp_path / args.output_dir / n).write_text("{}")
        return {"seconds": 1.5}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eval_cli, "run", fake_run)
    assert cli.main(["eval", "--small"]) == 0
    (out,) = (tmp_path / "doublesparse-eval").iterdir()
    assert (
        f"wrote results.json, table.md to doublesparse-eval/{out.name}/"
        in capsys.readouterr().out
    )


def test_calibrate_default_output(tmp_path, monkeypatch):
    from doublesparse.calibrate import cli as cal_cli
    from doublesparse.testing import ByteTokenizer, tiny_llama

    monkeypatch.chdir(tmp_path)
    args = cal_cli.build_parser().parse_args(
        ["--num-samples", "1", "--seq-len", "16", "--quiet"]
    )
    cal_cli.check_args(args)
    text = tmp_path / "t.txt"
    text.write_text("a few words of text " * 20)
    args.text = [str(text)]
    cal_cli.run(
        args, model=tiny_llama(max_position_embeddings=64), tokenizer=ByteTokenizer()
    )
    (written,) = (tmp_path / "doublesparse-calibrate").iterdir()
    assert written.name.startswith("tiny-llama-") and args.output == str(
        written.relative_to(tmp_path)
    )
    assert json.loads(written.read_text())[META_KEY]["model"] == "tiny-llama"
