"""`kvhandoff` command line: prepare, fit, refine, demo, tune, eval, eval-render, eval-switch, bench, bench-fit,
analyze, serve, bench-serve, load-test, guard-eval.

One module per command group; the options several commands share, and the parsers of command-line values,
live in `kvhandoff.cli.options`; failures are reported on one line (`kvhandoff.cli.group`). Each command
parses its options and calls library functions.
"""

from __future__ import annotations

import typer

from kvhandoff.cli import analyze, bench, demo, evaluate, measure, models, serve, switch, tune
from kvhandoff.cli.group import CommandGroup

app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
app.command()(models.prepare)
app.command()(models.fit)
app.command()(models.refine)
app.command()(demo.demo)
app.command()(tune.tune)
app.command("eval")(evaluate.eval_command)
app.command("eval-render")(evaluate.render_command)
app.command("eval-switch")(switch.eval_switch)
app.command()(bench.bench)
app.command("bench-fit")(bench.bench_fit)
app.command()(analyze.analyze)
app.command()(serve.serve)
app.command("bench-serve")(measure.bench_serve)
app.command("load-test")(measure.load_test)
app.command("guard-eval")(measure.guard_eval)


def main() -> None:
    """The console script `kvhandoff`."""
    app()
