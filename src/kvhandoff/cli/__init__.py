"""`kvhandoff` command line: prepare, fit, refine, demo, serve, guard-calibrate, vllm-config.

One module per command group; the options several commands share, and the parsers of command-line values,
live in `kvhandoff.cli.options`; failures are reported on one line (`kvhandoff.cli.group`). Each command
parses its options and calls library functions. The measurement commands are the lab's (`kvhandoff-lab`).
"""

from __future__ import annotations

import typer

from kvhandoff.cli import demo, guard, models, serve, vllm
from kvhandoff.cli.group import CommandGroup, show_library_messages

app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
app.command()(models.prepare)
app.command()(models.fit)
app.command()(models.refine)
app.command()(demo.demo)
app.command()(serve.serve)
app.command("guard-calibrate")(guard.guard_calibrate)
app.command("vllm-config")(vllm.vllm_config)


def main() -> None:
    """The console script `kvhandoff`."""
    show_library_messages("kvhandoff")
    app()
