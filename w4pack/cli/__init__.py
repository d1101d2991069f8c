"""The ``w4pack`` command line: a thin Click layer over the Python API.

Commands live one per module and are imported only when used, so ``w4pack --help`` is fast and a
command with heavy dependencies (torch, transformers) costs nothing to the others.
Exit codes: 0 ok, 1 verification failed, 2 bad input or usage, 3 unsupported input, 4 I/O, network or CUDA
kernel failure (an existing output without --force included), 130 interrupted (Ctrl-C at any point, during the
imports too: see w4pack._sigint, until the command's outcome is settled: see ``settle``). ``w4pack`` without a
command prints its help on stderr and exits 2, as click (8.2 and later) does for a group invoked without one.
Library warnings (numpy's overflow, torch's notices) are not printed, so an error stays one line; w4pack's own
notices are; W4PACK_DEBUG=1 shows everything, with tracebacks (same exit codes).
"""
from __future__ import annotations

import errno
import importlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import click

from .. import _sigint
from .._version import __version__
from ..errors import EXIT_BAD_INPUT, EXIT_IO, BadInputError, UnsupportedError, W4PackError

__all__ = ["cli", "main", "emit_json", "check_format_name", "detect_source", "check_endpoint", "require_packed",
           "plural", "SourcePath", "say_plan_error"]

#: command name -> "module:function"
COMMANDS: dict[str, str] = {
    "convert": "w4pack.cli.convert_cmd:convert",
    "inspect": "w4pack.cli.inspect_cmd:inspect",
    "validate": "w4pack.cli.validate_cmd:validate",
    "verify": "w4pack.cli.verify_cmd:verify",
    "run": "w4pack.cli.run_cmd:run",
    "push": "w4pack.cli.hub_cmd:push",
    "pull": "w4pack.cli.hub_cmd:pull",
}

EPILOG = ("Exit codes: 0 ok, 1 verification failed (verify only), 2 bad input or usage, 3 unsupported input, "
          "4 I/O, network or CUDA kernel failure (an existing output without --force included), 130 interrupted. "
          "Set W4PACK_DEBUG=1 for tracebacks.")


class BrokenPipe(Exception):
    """stdout was closed by its reader (``w4pack inspect ... | head -1``), raised past click: click would exit 1,
    which is "verification failed"."""


class Interrupted(Exception):
    """Ctrl-C inside a command, raised past click: click's own handling echoes an empty line on stderr first (to end
    the terminal's "^C" line) whatever stderr is, so a log or pipe got a blank line above the one-line message."""


class LazyGroup(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """``w4pack`` alone: the formatted help on stderr and exit 2 (a usage error), as click 8.2+ does for a group
        invoked without a command; not squashed into the one error line other usage errors get, and the same
        whatever click >= 8.1 is installed (8.1 printed it on stdout and exited 0)."""
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), err=True, color=ctx.color)
            ctx.exit(EXIT_BAD_INPUT)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise BrokenPipe() from None
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        ref = COMMANDS.get(name)
        if ref is None:
            return None
        mod, attr = ref.split(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except ModuleNotFoundError as exc:
            if exc.name == mod:
                return None  # command not part of this build
            raise


@click.group(cls=LazyGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="w4pack")
def cli() -> None:
    """Convert, pack, verify, run and publish 4-bit LLM checkpoints (GPTQ, AWQ, TOML tables,
    compressed-tensors, GGUF) in one interleaved int4 layout."""


def emit_json(doc: Any) -> None:
    """One JSON document on stdout (logs go to stderr)."""
    click.echo(json.dumps(doc, indent=2, default=str))


#: the format names --from and --to take, for the help texts (the registry is imported only when a command runs)
FORMAT_NAMES = "w4pack, gptq, gptq-v2, awq, toml, compressed-tensors, gguf"


def plural(n: int, word: str) -> str:
    """"1 shard", "2 shards": the summary lines count things that are often one (a small model's shard)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def check_format_name(name: str | None, option: str) -> str | None:
    """The format's own name for ``--from``/``--to`` (names are case-insensitive: ``--to GPTQ`` is gptq); an
    unknown one is a usage error (exit 2) naming the option, not unsupported input (3)."""
    if name is None:
        return None
    from ..formats import get_format

    try:
        return get_format(name).name
    except UnsupportedError as exc:
        raise BadInputError(f"{option}: {exc.message}") from None


class SourcePath(click.Path):
    """A source argument: a local path, or an ``hf://`` spec checked as typed. The Path that click.Path makes
    collapses ``//``, so an empty spec ``hf://`` became ``hf:``, a local name that "does not exist"; a malformed
    spec is refused here with the Hub's own wording (exit 2) instead."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.startswith("hf:/"):
            from ..hub import parse_hub_spec

            parse_hub_spec(value)
            check_endpoint(None)  # $HF_ENDPOINT, which the download will use: refused here, before any work
        return super().convert(value, param, ctx)


def say_plan_error(path: str | os.PathLike[str], doc: dict[str, Any],
                   where: str = "in the JSON's problems") -> None:
    """A plan (inspect of a source, convert --dry-run) that convert would stop at: the usual one error line on
    stderr beside the report (stdout, JSON or text), so a caller reading only stderr and the exit status learns
    why."""
    if not doc["exit_code"]:
        return
    probs = list(doc["problems"]) + list(doc.get("output_problems") or [])
    more = f" (and {len(probs) - 1} more, {where})" if len(probs) > 1 else ""
    first = probs[0] if probs else f"{path}: convert would stop here"
    click.echo(f"w4pack: error: {first}{more}", err=True)


def detect_source(path: str | os.PathLike[str]) -> str | None:
    """The format of a local source, as ``formats.detect`` (which names a broken JSON or safetensors file that made
    detection fail); None for a Hub source (``hf://``, detected after download).

    A .gguf without the GGUF magic is bad input naming the file (exit 2) instead of "cannot tell which format" (3),
    which would send the user to --from for a file that no format can read.
    """
    from ..formats import detect

    if str(path).startswith("hf:/"):
        return None
    try:
        return detect(path)
    except UnsupportedError:
        p = Path(path)
        if p.is_file() and p.suffix.lower() == ".gguf":
            with open(p, "rb") as fh:
                magic = fh.read(4)
            if magic != b"GGUF":
                raise BadInputError(f"not a GGUF file: it starts with {magic!r}, not b'GGUF' (truncated, or saved in "
                                    "another format)", file=str(p)) from None
        raise


def require_packed(path: str | os.PathLike[str], command: str, rest: str = "") -> None:
    """validate, verify, run and push take a packed w4pack folder. A path that is a checkpoint of another format
    (a GGUF file, a GPTQ folder) is bad input either way (exit 2), but the line says what to do, convert it first,
    instead of "not a folder" or "no w4pack.json"; anything else is left to the checkpoint reader's own error.
    ``rest``: the command's other arguments, for the suggested command line."""
    from ..formats import detect
    from ..store.names import MANIFEST_NAME

    from ..store.gguffile import gguf_files_in

    p = Path(path)
    if (p / MANIFEST_NAME).is_file() or not os.path.lexists(p):
        return
    try:
        found = detect(p)
    except W4PackError:
        found = None
    what, source = f"{found} checkpoint", p
    if found is None and p.is_dir():  # a folder a GGUF file was downloaded into: the model is the file
        ggufs = gguf_files_in(p)
        if not ggufs:
            return
        if len(ggufs) == 1:
            what, source = "folder holding a GGUF file", ggufs[0]
        else:
            shown = ", ".join(g.name for g in ggufs[:4]) + (f" and {len(ggufs) - 4} more" if len(ggufs) > 4 else "")
            what, source = f"folder holding {len(ggufs)} GGUF files ({shown})", p / "FILE.gguf"
    elif found is None or found == "w4pack":
        return
    article = "an" if what[0] in "aeiou" else "a"
    rest = f" --against {source}" if command == "verify" else (f" {rest}" if rest else "")
    raise BadInputError(f"{article} {what}, not a packed w4pack folder; {command} takes the output of convert: "
                        f"w4pack convert {source} OUT_DIR, then w4pack {command} OUT_DIR{rest}", file=str(p))


def check_endpoint(endpoint: str | None) -> None:
    """``--endpoint`` (or $HF_ENDPOINT) must be an http(s) URL: a usage error (exit 2) before any request, not a
    network failure (4). The check is the library's (w4pack.hub), which hf:// sources go through as well."""
    from ..hub import check_endpoint as hub_check_endpoint

    hub_check_endpoint(endpoint, "--endpoint")


def settle() -> None:
    """The command's outcome is decided (its output is in place, or nothing will be written): from here to the exit
    a Ctrl-C is ignored, so it cannot turn a finished conversion into "interrupted" (130), nor kill the process
    with SIGINT during the interpreter's shutdown (Python gives SIGINT its default action back there) after
    "converted ..." was printed. ``main`` restores the caller's handler; ``entry`` keeps it to the end."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no signal handling to change
        pass


def say_interrupted() -> None:
    """The interrupt message, one line. A leading newline only when stderr is a terminal, to end the line the
    terminal's "^C" echo (or a progress bar) left open; a log or a pipe gets the one line alone."""
    lead = "\n" if _isatty(sys.stderr) else ""
    click.echo(lead + _sigint.INTERRUPTED, err=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point: map every error to one line on stderr and a documented exit code. Run in-process (tests,
    scripts), the caller's SIGINT handler is put back on return (``settle`` may have changed it)."""
    try:
        before = signal.getsignal(signal.SIGINT)
    except ValueError:
        before = None
    try:
        return _main(argv)
    finally:
        if before is not None and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)


def _main(argv: list[str] | None = None) -> int:
    """``main`` without putting the SIGINT handler back: ``entry`` keeps a settled outcome's to the end."""
    try:
        _sigint.release()  # from here a Ctrl-C is a KeyboardInterrupt, which the commands clean up after
        debug = debug_enabled()
        if debug:
            return _run(argv, debug)
        import numpy as np

        # a library's warning on stderr would break the one-line contract: numpy's floating-point warnings are
        # not raised at all, other libraries' warnings are dropped; w4pack's own notices still show (_only_ours)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.showwarning = _only_ours(warnings.showwarning)
            fmt, warnings.formatwarning = warnings.formatwarning, _one_line_warning  # catch_warnings keeps neither
            try:
                return _run(argv, debug)
            finally:
                warnings.formatwarning = fmt
    except KeyboardInterrupt:  # between the handlers below, or while one of them prints
        settle()
        say_interrupted()
        return _sigint.EXIT_INTERRUPTED


_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


def _one_line_warning(message: Any, category: Any, filename: str, lineno: int, line: Any = None) -> str:
    """One line, as the errors are: Python's own form adds the source file, line and code beneath the message."""
    return "warning: " + " ".join(str(message).split("\n")) + "\n"


def _only_ours(show: Any) -> Any:
    """A ``warnings.showwarning`` that passes on (to ``show``) the warnings w4pack's own code issues, its notices to
    the user, and drops those issued inside other packages (torch, transformers, huggingface_hub...)."""
    def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == warnings.__file__:
            frame = frame.f_back  # warnings' own Python frames; the issuing code is the first frame above them
        if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            show(message, category, filename, lineno, file, line)

    return showwarning


def debug_enabled() -> bool:
    """$W4PACK_DEBUG set to anything but empty or "0" (``W4PACK_DEBUG=0`` turns it off, as the other switches)."""
    return os.environ.get("W4PACK_DEBUG", "").strip() not in ("", "0")


def _traceback() -> None:
    """W4PACK_DEBUG: the traceback of the exception being handled, on stderr, above the one-line error. The exit
    status stays the documented one: an uncaught exception would exit 1, which means "verification failed"."""
    import traceback

    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()


def _run(argv: list[str] | None, debug: bool) -> int:
    """The command, its errors mapped to one line and an exit status; once that status is known it stands."""
    try:
        return _run_command(argv, debug)
    finally:
        settle()


def _run_command(argv: list[str] | None, debug: bool) -> int:
    try:
        rv = cli.main(args=argv, prog_name="w4pack", standalone_mode=False)
        return int(rv or 0) if isinstance(rv, int) else 0
    except W4PackError as exc:
        if debug:
            _traceback()
        click.echo(f"w4pack: error: {exc.one_line()}", err=True)
        return exc.exit_code
    except BrokenPipe:
        try:  # nothing more can reach stdout: let the interpreter's final flush go nowhere instead of failing
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        click.echo("w4pack: error: stdout was closed before all output was written (broken pipe)", err=True)
        return EXIT_IO
    except click.exceptions.Abort as exc:
        # click turns Ctrl-C inside a command into Abort (raised from the KeyboardInterrupt)
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):  # (click already ended the line)
            click.echo(_sigint.INTERRUPTED, err=True)
            return _sigint.EXIT_INTERRUPTED
        click.echo("w4pack: aborted", err=True)
        return EXIT_BAD_INPUT
    except click.ClickException as exc:  # one line as every error (click's own form is Usage, Try and Error)
        ctx = getattr(exc, "ctx", None)
        see = f" (see: {ctx.command_path} --help)" if isinstance(exc, click.UsageError) and ctx is not None else ""
        msg = " ".join(exc.format_message().split())
        click.echo(f"w4pack: error: {msg}{see}", err=True)
        return EXIT_BAD_INPUT
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except (Interrupted, KeyboardInterrupt):
        say_interrupted()
        return _sigint.EXIT_INTERRUPTED
    except OSError as exc:
        if debug:
            _traceback()
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        click.echo(f"w4pack: error: {where}{exc.strerror or exc}", err=True)
        return EXIT_IO
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, no traceback
        if debug:
            _traceback()
        if _from_interrupt(exc):  # Ctrl-C inside an import that wraps it (3.11's "Error calling __set_name__")
            say_interrupted()
            return _sigint.EXIT_INTERRUPTED
        click.echo(f"w4pack: error: unexpected {type(exc).__name__}: {exc} "
                   "(this is a bug or an input w4pack does not understand; W4PACK_DEBUG=1 shows a traceback)",
                   err=True)
        return EXIT_BAD_INPUT


def _from_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt caused ``exc``: Python wraps one raised in a class's ``__set_name__`` (during a
    lazy ``import huggingface_hub``) in a RuntimeError, which read "unexpected RuntimeError" and exit 2."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def entry() -> None:
    """The ``w4pack`` command (console script and ``python -m w4pack``)."""
    try:
        rc = _main()  # (not main: a settled outcome keeps SIGINT ignored through the shutdown)
        sys.stdout.flush()
        sys.stderr.flush()
    except KeyboardInterrupt:  # after main returned, before the flush finished (an outcome not settled)
        rc = _sigint.EXIT_INTERRUPTED
        os.write(2, (_sigint.INTERRUPTED + "\n").encode())
    _sigint.exit_on_interrupt()  # interpreter shutdown (atexit hooks of torch and others): no traceback either
    sys.exit(rc)
