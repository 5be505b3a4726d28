"""What every ``doublesparse`` subcommand shares: help that shows defaults, and errors as one line.

A mistake in what the user asked for (a missing file, a bad value, a busy port) is reported as
``<prog>: error: <what was wrong, where, what to do>`` with exit status 2, without a traceback;
``--debug`` shows the traceback instead. So are the ``ValueError`` s the loaders and configs raise
(a damaged checkpoint, text too short to calibrate on: the message names the file or value). Errors
of the machine (a file that cannot be read, out of memory) are one line with exit status 1.
Anything else is a bug and keeps its traceback.

    parser = Parser(prog="doublesparse x", description=...)     # adds --debug
    def main(argv=None): return run_main(parser.prog, _main, argv)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence


class UsageError(Exception):
    """A flag or input the user gave is wrong: one line, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to each flag's help unless the help already names its default or
    there is none to show (``None``, ``False``, suppressed)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        d = action.default
        if "default" in h.lower() or d is None or d is False or d is argparse.SUPPRESS:
            return h
        if not action.option_strings or action.nargs == 0:
            return h
        shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else d
        return f"{h} (default: {shown})".lstrip() if h else f"default: {shown}"

    def _format_action(self, action: argparse.Action) -> str:
        # argparse skips the help line when there is no help text; a default alone is worth one
        if not action.help and action.option_strings and self._get_help_string(action):
            action.help = self._get_help_string(action).replace("%", "%%")
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose help shows defaults and whose errors are one line, with
    ``--debug`` (show tracebacks)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug",
            action="store_true",
            help="on an error, show the full traceback instead of one line",
        )

    def error(self, message: str):
        # run_main prints it as one line (argparse would print the whole usage block first)
        raise UsageError(f"{message} (see {self.prog} --help)")


def flag_of(field: str) -> str:
    """``max_total_tokens`` -> ``--max-total-tokens``."""
    return "--" + field.replace("_", "-")


def with_flag_names(message: str, fields: Sequence[str]) -> str:
    """A config's error message with its field names spelled as the CLI flags that set them."""
    names = sorted(fields, key=len, reverse=True)
    if not names:
        return message
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])"
    return re.sub(pattern, lambda m: flag_of(m.group(1)), message)


# Exceptions a user can act on without reading code: the message is the report.
_OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _one_line(e: BaseException) -> str:
    if (
        isinstance(e, OSError) and e.filename and e.strerror
    ):  # "[Errno 2] ...: 'x'" -> "x: ..."
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__


def run_main(
    prog: str, body: Callable[[list[str]], int | None], argv: Sequence[str] | None
) -> int:
    """Run a subcommand's ``body(argv)``; user errors become one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        return int(body(argv) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (ValueError, *_OS_ERRORS) as e:
        if debug:
            raise
        print(
            f"{prog}: error: {_one_line(e)} (--debug shows the traceback)",
            file=sys.stderr,
        )
        return 2 if isinstance(e, ValueError) else 1
    except (MemoryError, RuntimeError) as e:
        # torch.cuda.OutOfMemoryError is a RuntimeError; other RuntimeErrors are bugs
        if debug or not (
            isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
        ):
            raise
        first = _one_line(e).split(". ")[0]
        print(
            f"{prog}: error: out of memory ({first}); a smaller --max-total-tokens, "
            f"--mem-fraction-static or --context-length may fit",
            file=sys.stderr,
        )
        return 1


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse ``type``: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
    return v


def unit_fraction(text: str) -> float:
    """argparse ``type``: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v
