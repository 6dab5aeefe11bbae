"""How the command line reports: failures on one line on stderr, never a traceback; the library's log messages.

A bad value on the command line (click's usage errors, and `typer.BadParameter` from the option parsers) →
``error: Invalid value for '--top-k': …`` and exit code 2; a KVHandoffError from the library → ``error: …``
and exit code 1. The library logs what it does (a conversion's steps, a cache entry it cannot use) at INFO and
WARNING; `show_library_messages` puts those lines on stderr.
"""

from __future__ import annotations

import logging
import sys

import typer
from typer.core import TyperGroup

from kvhandoff.errors import KVHandoffError

USAGE_EXIT = 2
LIBRARY_EXIT = 1
#: how a library log message reads on the console
MESSAGE_FORMAT = "[kvhandoff] %(message)s"


def show_library_messages(*packages: str) -> None:
    """Log records of ``packages`` (and their modules) at INFO and above on stderr, one line each; the loggers of
    other libraries keep their own settings. A logger that already has a handler is left as it is."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(MESSAGE_FORMAT))
    for name in packages:
        package_logger = logging.getLogger(name)
        if not package_logger.handlers:
            package_logger.addHandler(handler)
            package_logger.setLevel(logging.INFO)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class CommandGroup(TyperGroup):
    """The `kvhandoff` command group, with failures reported on one line (see the module docstring)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        except typer.TyperException as exc:  # typer's (vendored click's) usage errors
            if type(exc).__name__ == "NoArgsIsHelpError":  # `kvhandoff` alone: the help, not an error line
                exc.show()
            else:
                typer.echo(f"error: {_one_line(exc.format_message())}", err=True)
            sys.exit(getattr(exc, "exit_code", USAGE_EXIT))
        except KVHandoffError as exc:
            typer.echo(f"error: {_one_line(str(exc))}", err=True)
            sys.exit(LIBRARY_EXIT)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)
