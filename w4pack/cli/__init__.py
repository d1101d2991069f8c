"""The ``w4pack`` command line: a thin Click layer over the Python API.

Commands live one per module and are imported only when used, so ``w4pack --help`` is fast and a
command with heavy dependencies (torch, transformers) costs nothing to the others.
Exit codes: 0 ok, 1 verification failed, 2 bad input or usage, 3 unsupported input, 4 I/O or network.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from .. import __version__
from ..errors import EXIT_BAD_INPUT, EXIT_IO, W4PackError

__all__ = ["cli", "main", "emit_json"]

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

EPILOG = ("Exit codes: 0 ok, 1 verification failed, 2 bad input or usage, 3 unsupported input, "
          "4 I/O or network. Set W4PACK_DEBUG=1 for tracebacks.")


class LazyGroup(click.Group):
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: map every error to one line on stderr and a documented exit code."""
    debug = bool(os.environ.get("W4PACK_DEBUG"))
    try:
        rv = cli.main(args=argv, prog_name="w4pack", standalone_mode=False)
        return int(rv or 0) if isinstance(rv, int) else 0
    except W4PackError as exc:
        if debug:
            raise
        click.echo(f"w4pack: error: {exc.one_line()}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("w4pack: aborted", err=True)
        return EXIT_BAD_INPUT
    except click.ClickException as exc:
        exc.show()
        return EXIT_BAD_INPUT
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("w4pack: interrupted; no output was left half-written", err=True)
        return 130
    except OSError as exc:
        if debug:
            raise
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        click.echo(f"w4pack: error: {where}{exc.strerror or exc}", err=True)
        return EXIT_IO
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, no traceback
        if debug:
            raise
        click.echo(f"w4pack: error: unexpected {type(exc).__name__}: {exc} "
                   "(this is a bug or an input w4pack does not understand; W4PACK_DEBUG=1 shows a traceback)",
                   err=True)
        return EXIT_BAD_INPUT


def entry() -> None:
    sys.exit(main())
