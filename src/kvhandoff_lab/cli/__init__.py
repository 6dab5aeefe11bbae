"""`kvhandoff-lab` command line: tune, eval, eval-render, eval-switch, bench, bench-fit, bench-llama-cpp,
eval-llama-cpp, bench-vllm, eval-vllm, analyze, bench-serve, load-test, load-hostile, bench-concurrency, guard-eval,
bench-agent, bench-handoff, eval-offset, eval-heal.

The lab's measurements of the product: one module per command group, sharing the product's option parsers
(`kvhandoff.cli.options`) and its one-line failure reports (`kvhandoff.cli.group`).
"""

from __future__ import annotations

import typer

from kvhandoff.cli.group import CommandGroup, show_library_messages
from kvhandoff_lab.cli import analyze, bench, evaluate, measure, switch, tune

app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
app.command()(tune.tune)
app.command("eval")(evaluate.eval_command)
app.command("eval-render")(evaluate.render_command)
app.command("eval-switch")(switch.eval_switch)
app.command()(bench.bench)
app.command("bench-fit")(bench.bench_fit)
app.command("bench-llama-cpp")(bench.bench_llama_cpp)
app.command("eval-llama-cpp")(bench.eval_llama_cpp)
app.command("bench-vllm")(bench.bench_vllm)
app.command("eval-vllm")(bench.eval_vllm)
app.command("eval-offset")(bench.eval_offset)
app.command("eval-heal")(bench.eval_heal)
app.command()(analyze.analyze)
app.command("bench-serve")(measure.bench_serve)
app.command("load-test")(measure.load_test)
app.command("load-hostile")(measure.load_hostile)
app.command("bench-concurrency")(measure.bench_concurrency)
app.command("guard-eval")(measure.guard_eval)
app.command("bench-agent")(measure.bench_agent)
app.command("bench-handoff")(measure.bench_handoff)


def main() -> None:
    """The console script `kvhandoff-lab`."""
    show_library_messages("kvhandoff", "kvhandoff_lab")
    app()
