"""A tool-using agent benchmark through the server (`kvhandoff-lab bench-agent`): GSM8K problems solved with a
calculator, the conversation switching between the small and the large model, with the KV handoff or a re-prefill.

Problems: GSM8K test problems of the *report* pool (`tasks.pool_of`; the dev pool is what tuning uses), shuffled by
seed as `runner.select_items` shuffles them, the first N taken. Tools: ``calculator(expression)`` (a sandboxed `ast`
evaluator, never eval) and ``final_answer(answer)``. Each problem and condition is one fresh session: the system
prompt, worked examples as earlier turns (assistant tool calls and their results) and the problem; then one streamed
request per step through the official ``openai`` client (loopback only), each step answered by exactly one forced
tool call: the first ``min_calls`` steps must call the calculator (tool_choice named), later ones call either tool
(tool_choice "required"). A calculator call gets its result as a tool message; final_answer ends the problem; an
answer without a valid call gets an error message and the next step.

Conditions (rows): "large" and "small" (every step on one model), "handoff" and "reprefill" (the switching schedule:
odd steps on the small model, even steps, each right after a tool result, on the large one; at a switch the
conversation's cache is mapped (kv_handoff.mode "auto") or the receiving model re-prefills it ("reprefill")). With
``min_calls`` ≥ 2 and ``max_steps`` ≥ 3 every switching episode has at least two switches (steps 2 and 3).

Measured per condition: solve rate (final_answer within 1e-6 relative of the gold answer) with a bootstrap interval,
the paired difference handoff − reprefill, the valid tool-call rate, the client's time to the first chunk at the
switch steps (a step whose model differs from the previous step's) with the server's kv_handoff report, the history
at the switches (prompt tokens) and the wall time per problem.

The JSON (`AGENT_FORMAT`): ``settings`` (the run's knobs, models, prompt checksum and tokens), ``problems`` (per
problem its id, question, gold answer, history tokens and per condition the episode: answer, solved, stopped, switches,
wall_s and its ``steps``, each with model, switch, tool_choice, times, the server's kv_handoff report and status,
prompt tokens, tool calls, validity and the tool's result), ``runs`` (one per invocation: problems run, early stop)
and ``summary`` (`summarize_agent`). It is written after every problem; a rerun with the same file and settings skips
the problems it holds.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import operator
import os
import platform
import random
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import kvhandoff
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.progress import Progress, as_progress
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.parse import SESSION_HEADER
from kvhandoff.serving.respond import HANDOFF_HEADER
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig
from kvhandoff.serving.tools import ToolCall, parse_tools, validate_arguments
from kvhandoff_lab.evaluation.data import oe_requests
from kvhandoff_lab.evaluation.metrics import paired_bootstrap
from kvhandoff_lab.evaluation.tasks import gsm8k_gold, gsm8k_id, pool_of
from kvhandoff_lab.serving.client import TurnResult, require_loopback
from kvhandoff_lab.serving.loadtest import percentile

logger = logging.getLogger(__name__)

AGENT_FORMAT = "kvhandoff-agent-bench/1"
#: the rows: every step on one model, or the switching schedule with the handoff or with a re-prefill
CONDITIONS = ("large", "small", "handoff", "reprefill")
SWITCHING = ("handoff", "reprefill")
#: the kv_handoff.mode each condition sends
CONDITION_MODES = {"large": "auto", "small": "auto", "handoff": "auto", "reprefill": "reprefill"}
DEFAULT_MAX_STEPS = 6
DEFAULT_MAX_TOKENS = 96
DEFAULT_MIN_CALLS = 2
#: the system prompt and worked examples must render to at least this many tokens
MIN_HISTORY_TOKENS = 1000
#: a final answer is right within this relative tolerance of the gold answer
RELATIVE_TOLERANCE = 1e-6
GSM8K_REQUESTS = "gsm8k/gold_bpb_5shot"
SCHEDULE_NOTE = ("switching rows: odd steps small, even steps (each right after a tool result) large; steps "
                 "1..min_calls must call the calculator, later steps calculator or final_answer")

# -- the calculator ---------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 200
MAX_EXPONENT = 100
MAX_DIGITS = 100
MAX_MAGNITUDE = 10**MAX_DIGITS
ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are limited to ±{MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1 \
            and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise CalculatorError(f"the result is too large (over {MAX_DIGITS} digits)")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("the result is not a real number")
    return result


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _power}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _checked(value):
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"the result is too large (over {MAX_DIGITS} digits)")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "an attribute"
    if isinstance(node, ast.Tuple):
        return "a comma (write 1000, not 1,000)"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"{type(node).__name__}"


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"{_describe(node)} is not allowed: use only {ALLOWED}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary minus and plus, parentheses; bounded
    in length, exponent and result size. Walks the parsed tree itself (never eval); CalculatorError otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression ({exc.msg}): use only {ALLOWED}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression ({type(exc).__name__})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def format_number(value: int | float) -> str:
    """A result as the tool returns it: integers (and integral floats) without a fraction, others to 12 digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


def calculator(expression: str) -> str:
    """The calculator tool's result text: the value, or "error: ..." saying why there is none."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


# -- tools, prompt, problems ------------------------------------------------------------------------------------

TOOLS: tuple[dict, ...] = (
    {"type": "function", "function": {
        "name": "calculator",
        "description": f"Evaluate one arithmetic expression ({ALLOWED}) and return its value.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "maxLength": MAX_EXPRESSION_CHARS, "description": "for example (32 + 42) - 35"}},
            "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "final_answer",
        "description": "Submit the final answer to the problem, a plain number without units; ends the problem.",
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "number", "description": "the final answer"}},
            "required": ["answer"], "additionalProperties": False}}},
)
#: the tools as the server checks them (`tools.validate_arguments`)
TOOL_SPECS = parse_tools(list(TOOLS)).tools
CALCULATOR_CHOICE = {"type": "function", "function": {"name": "calculator"}}
NOT_A_CALL = ("That reply was not a complete tool call. Reply with exactly one call: calculator(expression) or "
              "final_answer(answer).")

SYSTEM_PROMPT = (
    "You are a careful assistant that solves grade-school math word problems with tools. Every reply is exactly "
    "one tool call and nothing else.\n"
    f"- calculator(expression) evaluates one arithmetic expression. Use only {ALLOWED}: no words, units, $ signs "
    "or thousands separators. It returns the value, or an error message; after an error, fix the expression and "
    "call the calculator again.\n"
    "- final_answer(answer) submits the final answer as a plain number and ends the problem.\n"
    "Work step by step: compute one intermediate quantity per calculator call, read its result, then make the next "
    "call. Check that every quantity the question mentions has been used. When a result answers the question, "
    "call final_answer with that number."
)


@dataclass(frozen=True)
class WorkedExample:
    """A solved problem shown as earlier turns: the calculator calls in order (their results computed by
    `calculator`), then the final answer."""

    question: str
    expressions: tuple[str, ...]
    answer: float


@dataclass(frozen=True)
class AgentPrompt:
    """The conversation every problem starts from: a system prompt and worked examples."""

    system: str = SYSTEM_PROMPT
    examples: tuple[WorkedExample, ...] = ()

    def messages(self) -> list[dict]:
        """The system turn and each example as a user question, assistant tool calls and tool results."""
        messages: list[dict] = [{"role": "system", "content": self.system}]
        for number, example in enumerate(self.examples, 1):
            messages.append({"role": "user", "content": example.question})
            calls = [("calculator", {"expression": e}, calculator(e)) for e in example.expressions]
            calls.append(("final_answer", {"answer": example.answer}, f"answer recorded: "
                                                                      f"{format_number(example.answer)}"))
            for index, (name, arguments, result) in enumerate(calls, 1):
                ident = f"call_example{number}_{index}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": ident, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
                messages.append({"role": "tool", "tool_call_id": ident, "content": result})
        return messages

    def checksum(self) -> str:
        text = json.dumps({"messages": self.messages(), "tools": TOOLS}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


#: multi-step exemplars of Wei et al. (the 8-shot GSM8K prompt's; not test problems), the third showing an error
WORKED_EXAMPLES = (
    WorkedExample("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left "
                  "in total?", ("32 + 42", "74 - 35"), 39),
    WorkedExample("There were nine computers in the server room. Five more computers were installed each day, from "
                  "monday to thursday. How many computers are now in the server room?", ("5 * 4", "9 + 20"), 29),
    WorkedExample("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
                  ("5 x 3", "5 * 3", "23 - 15"), 8),
    WorkedExample("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How "
                  "many golf balls did he have at the end of wednesday?", ("58 - 23", "35 - 2"), 33),
    WorkedExample("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does "
                  "he have now?", ("2 * 2", "5 + 4"), 9),
)
DEFAULT_PROMPT = AgentPrompt(SYSTEM_PROMPT, WORKED_EXAMPLES)


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: float


def gsm8k_problems(count: int | None = None, seed: int = 0) -> list[Problem]:
    """GSM8K test problems of the report pool (disjoint from the dev pool tuning uses) in `runner.select_items`'
    order for ``seed``, the first ``count`` (None: all), with their gold answers as numbers."""
    docs = [r["doc"] for r in oe_requests(GSM8K_REQUESTS)]
    pool = [doc for doc in docs if pool_of("gsm8k", gsm8k_id(doc)) == "report"]
    random.Random(f"{seed}/gsm8k/report").shuffle(pool)
    if count is not None:
        if not 1 <= count <= len(pool):
            raise ConfigError(f"problems: the GSM8K report pool holds {len(pool)}, asked for {count}")
        pool = pool[:count]
    return [Problem(gsm8k_id(doc), doc["question"], float(gsm8k_gold(doc["answer"]).replace(",", "")))
            for doc in pool]


def is_correct(answer: float | None, gold: float) -> bool:
    """Whether ``answer`` equals ``gold`` within `RELATIVE_TOLERANCE` (relative; 1e-9 absolute near zero)."""
    return answer is not None and math.isclose(answer, gold, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-9)


# -- the schedule and one step ----------------------------------------------------------------------------------


def step_model(condition: str, step: int, small: str, large: str) -> str:
    """The model answering step ``step`` (1-based): one model throughout for "large" / "small"; on the switching
    rows the small model at odd steps and the large one at even steps."""
    if condition not in CONDITIONS:
        raise ConfigError(f"unknown condition {condition!r} (one of {', '.join(CONDITIONS)})")
    if condition in ("large", "small"):
        return large if condition == "large" else small
    return small if step % 2 else large


def tool_choice_of(step: int, min_calls: int) -> str | dict:
    """The calculator (named) for the first ``min_calls`` steps, then "required" (calculator or final_answer)."""
    return CALCULATOR_CHOICE if step <= min_calls else "required"


def guaranteed_switches(max_steps: int, min_calls: int) -> int:
    """Switches every switching episode has: it cannot end before step min(min_calls + 1, max_steps)."""
    return min(min_calls + 1, max_steps) - 1


def _openai():
    """The official ``openai`` client package (imported only to measure)."""
    try:
        import openai
    except ModuleNotFoundError:
        raise ConfigError("the agent bench talks to the server with the official client: pip install openai") from None
    return openai


@dataclass
class ToolTurn(TurnResult):
    """A streamed step: `TurnResult` with the tool calls accumulated from ``delta.tool_calls`` (id, name,
    arguments), the finish reason and the X-KV-Handoff header."""

    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    header_status: str | None = None


def stream_step(client, model: str, messages: list[dict], session: str, tool_choice, max_tokens: int,
                mode: str = "auto") -> ToolTurn:
    """One streamed chat request with the tools through the ``openai`` client; times from sending it to the first
    chunk (``first_chunk_s``) and to the first content or tool-call delta (``ttft_s``). Failures are returned in
    ``error``, never raised."""
    openai = _openai()
    result = ToolTurn(model)
    calls: dict[int, dict] = {}
    started = time.perf_counter()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, tools=list(TOOLS), tool_choice=tool_choice, parallel_tool_calls=False,
            max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_headers={SESSION_HEADER: session}, extra_body={"kv_handoff": {"mode": mode}})
        result.header_status = raw.headers.get(HANDOFF_HEADER)
        with raw.parse() as stream:
            for chunk in stream:
                now = time.perf_counter() - started
                if result.first_chunk_s is None:
                    result.first_chunk_s = now
                extra = chunk.model_extra or {}
                if extra.get("kv_handoff"):
                    result.handoff = extra["kv_handoff"]
                    result.status = result.handoff["status"]
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content:
                        result.text += delta.content
                    for call in delta.tool_calls or ():
                        entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                        entry["id"] = call.id or entry["id"]
                        if call.function is not None:
                            entry["name"] += call.function.name or ""
                            entry["arguments"] += call.function.arguments or ""
                    if (delta.content or delta.tool_calls) and result.ttft_s is None:
                        result.ttft_s = now
                    if choice.finish_reason:
                        result.finish_reason = choice.finish_reason
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    result.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        result.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
    result.total_s = time.perf_counter() - started
    result.tool_calls = [calls[index] for index in sorted(calls)]
    if result.status is None and result.error is None:
        result.status = result.header_status
    return result


@dataclass(frozen=True)
class Move:
    """What a step's answer does to the conversation: the messages to add, whether its call is valid (parses and
    fits its tool's schema) and why not, the tool's result, and the final answer when it gave one."""

    messages: list[dict]
    valid: bool
    problem: str | None = None
    result: str | None = None
    answer: float | None = None


def next_move(content: str | None, calls: list[dict], finish_reason: str | None = None) -> Move:
    """The agent's response to one answer: a valid calculator call gets its result, a valid final_answer ends the
    problem, an invalid call gets the reason as its tool result, an answer without a call gets `NOT_A_CALL`."""
    if not calls:
        why = "no tool call" + (" (the answer reached max_tokens)" if finish_reason == "length" else "")
        return Move([{"role": "assistant", "content": content or ""}, {"role": "user", "content": NOT_A_CALL}],
                    False, why)
    call = calls[0]
    ident = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    assistant = {"role": "assistant", "content": content, "tool_calls": [
        {"id": ident, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}
    problem = validate_arguments(ToolCall(ident, call["name"], call["arguments"]), TOOL_SPECS)
    if problem is None and len(calls) > 1:
        problem = f"{len(calls)} calls in one answer (one is asked for)"
    if problem is not None:
        result = f"error: {problem}"
        return Move([assistant, {"role": "tool", "tool_call_id": ident, "content": result}], False, problem, result)
    arguments = json.loads(call["arguments"])
    if call["name"] == "final_answer":
        answer = float(arguments["answer"])
        return Move([assistant], True, answer=answer, result=f"answer recorded: {format_number(answer)}")
    result = calculator(arguments["expression"])
    return Move([assistant, {"role": "tool", "tool_call_id": ident, "content": result}], True, result=result)


# -- settings and episodes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentSettings:
    """The benchmark's knobs: steps per problem, answer tokens per step, forced calculator steps, the rows."""

    max_steps: int = DEFAULT_MAX_STEPS
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_calls: int = DEFAULT_MIN_CALLS
    conditions: tuple[str, ...] = CONDITIONS

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_tokens < 1:
            raise ConfigError("max_steps and max_tokens must be positive")
        if not 0 <= self.min_calls < self.max_steps:
            raise ConfigError(f"min_calls must be in 0..max_steps - 1 ({self.max_steps - 1}), got {self.min_calls}")
        unknown = [c for c in self.conditions if c not in CONDITIONS]
        if unknown or not self.conditions:
            raise ConfigError(f"conditions: give some of {', '.join(CONDITIONS)}, got {list(self.conditions)}")
        object.__setattr__(self, "conditions", tuple(c for c in CONDITIONS if c in self.conditions))


def run_episode(client, problem: Problem, condition: str, small: str, large: str, prompt_messages: list[dict],
                settings: AgentSettings) -> dict:
    """One problem under one condition in a fresh session (module docstring); its record."""
    session = f"agent-{problem.id}-{condition}-{uuid.uuid4().hex[:8]}"
    messages = [*prompt_messages, {"role": "user", "content": problem.question}]
    mode = CONDITION_MODES[condition]
    steps, answer, stopped, previous = [], None, "max_steps", None
    started = time.perf_counter()
    for step in range(1, settings.max_steps + 1):
        model = step_model(condition, step, small, large)
        choice = tool_choice_of(step, settings.min_calls)
        turn = stream_step(client, model, messages, session, choice, settings.max_tokens, mode)
        record = {"step": step, "model": model, "switch": previous is not None and model != previous,
                  "tool_choice": choice if isinstance(choice, str) else choice["function"]["name"],
                  **turn.to_dict()}
        previous = model
        if turn.error:
            steps.append({**record, "valid": False, "problem": None, "result": None})
            stopped = "error"
            logger.warning("%s %s step %d: %s", problem.id, condition, step, turn.error)
            break
        move = next_move(turn.text or None, turn.tool_calls, turn.finish_reason)
        steps.append({**record, "valid": move.valid, "problem": move.problem, "result": move.result})
        messages += move.messages
        if move.answer is not None:
            answer, stopped = move.answer, "final_answer"
            break
    return {"condition": condition, "session": session, "answer": answer, "solved": is_correct(answer, problem.answer),
            "stopped": stopped, "steps": steps, "switches": sum(s["switch"] for s in steps),
            "wall_s": time.perf_counter() - started}


def _http(url: str, timeout_s: float) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout_s, trust_env=False)


def count_tokens(http: httpx.Client, model: str, messages: list[dict], generation_prompt: bool = True) -> int:
    """The server's token count of ``messages`` with the tools (POST /tokenize)."""
    response = http.post("/tokenize", json={"model": model, "messages": messages, "tools": list(TOOLS),
                                            "add_generation_prompt": generation_prompt})
    if response.status_code != 200:
        raise ConfigError(f"/tokenize failed: HTTP {response.status_code}: {response.text[:300]}")
    return int(response.json()["count"])


def hosted_models(http: httpx.Client) -> list[str]:
    response = http.get("/v1/models")
    response.raise_for_status()
    return [card["id"] for card in response.json()["data"]]


def _warm_up(client, small: str, large: str, prompt_messages: list[dict]) -> None:
    """Untimed: a short forced call on each model and a switch each way in both modes (first-request costs)."""
    messages = [*prompt_messages, {"role": "user", "content": "What is 2 + 3?"}]
    for mode in ("auto", "reprefill"):
        session = f"agent-warmup-{uuid.uuid4().hex[:8]}"
        for model in (small, large, small):
            stream_step(client, model, messages, session, "required", 4, mode)


def _resume_key(settings: dict) -> dict:
    return {key: settings.get(key) for key in ("seed", "max_steps", "max_tokens", "min_calls", "conditions",
                                               "models", "prompt_checksum", "server")}


def load_previous(out: Path | None, settings: dict) -> dict | None:
    """The results already in ``out`` when they were made with the same settings (None: no file); ConfigError when
    the settings differ."""
    if out is None or not Path(out).is_file():
        return None
    previous = json.loads(Path(out).read_text())
    if previous.get("format") != AGENT_FORMAT:
        raise ConfigError(f"{out} is not an agent bench result ({previous.get('format')!r}); give another --out")
    old, new = _resume_key(previous["settings"]), _resume_key(settings)
    differ = [key for key in new if old[key] != new[key]]
    if differ:
        raise ConfigError(f"{out} holds results made with other settings ({', '.join(differ)}); rerun with the "
                          "same ones to resume, or give another --out")
    return previous


def agent_over_http(url: str, problems: list[Problem], settings: AgentSettings = AgentSettings(),
                    seed: int = 0, prompt: AgentPrompt = DEFAULT_PROMPT, out: str | Path | None = None,
                    time_budget_s: float | None = None, min_history_tokens: int = MIN_HISTORY_TOKENS,
                    warmup: bool = True, server: dict | None = None, models: list[str] | None = None,
                    timeout_s: float = 600.0, progress: Progress | bool = False) -> dict:
    """Run every problem under every condition against the server at ``url`` (loopback only); the first two hosted
    models (or ``models``) are the small and the large one. The result (module docstring), written to ``out`` after
    every problem; problems already in ``out`` are skipped. No problem starts after ``time_budget_s`` seconds."""
    openai = _openai()
    url = require_loopback(url)
    if time_budget_s is not None and time_budget_s <= 0:
        raise ConfigError("time_budget_s must be positive")
    started = time.monotonic()
    with _http(url, timeout_s) as http:
        names = models or hosted_models(http)
        if len(names) < 2:
            raise ConfigError(f"the agent bench switches between two models; the server hosts {names}")
        small, large = names[0], names[1]
        prompt_messages = prompt.messages()
        prompt_tokens = count_tokens(http, small, prompt_messages, generation_prompt=False)
        if prompt_tokens < min_history_tokens:
            raise ConfigError(f"the agent prompt renders to {prompt_tokens} tokens, fewer than the "
                              f"{min_history_tokens} asked for")
        run_settings = {
            "seed": seed, **{k: v for k, v in asdict(settings).items() if k != "conditions"},
            "conditions": list(settings.conditions), "models": {"small": small, "large": large},
            "prompt_checksum": prompt.checksum(), "prompt_tokens": prompt_tokens,
            "min_history_tokens": min_history_tokens, "worked_examples": len(prompt.examples),
            "guaranteed_switches": guaranteed_switches(settings.max_steps, settings.min_calls),
            "server": server, "temperature": 0.0, "schedule": SCHEDULE_NOTE,
            "problems_source": f"GSM8K test split ({GSM8K_REQUESTS}), report pool (tasks.pool_of), shuffled as "
                               "runner.select_items does for the seed",
            "solved": f"final_answer within {RELATIVE_TOLERANCE} relative of the gold answer",
            "ttft": "client: request sent → first SSE chunk (openai client, streaming, loopback HTTP)",
            "valid_call": "the answer holds one tool call whose arguments fit its tool's schema "
                          "(tools.validate_arguments); an answer without a call is invalid",
        }
        if any(c in SWITCHING for c in settings.conditions) and run_settings["guaranteed_switches"] < 2:
            logger.warning("with max_steps %d and min_calls %d a switching episode may have fewer than 2 switches",
                           settings.max_steps, settings.min_calls)
        result = load_previous(Path(out) if out is not None else None, run_settings) or {
            "format": AGENT_FORMAT, "kvhandoff_version": kvhandoff.__version__, "settings": run_settings,
            "problems": [], "runs": []}
        done = {entry["id"] for entry in result["problems"]}
        todo = [p for p in problems if p.id not in done]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="kvhandoff-lab", max_retries=0, timeout=timeout_s,
                               http_client=openai.DefaultHttpxClient(trust_env=False, timeout=timeout_s))
        run = {"started_unix": time.time(), "time_budget_s": time_budget_s, "problems_asked": len(problems),
               "already_done": len(problems) - len(todo),
               "problems_run": 0, "stopped_early": False, "not_started": [],
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
        result["runs"].append(run)
        try:
            if warmup and todo:
                _warm_up(client, small, large, prompt_messages)
            bar = as_progress(progress)(total=len(todo), desc="agent bench", unit="problem")
            with bar:
                for index, problem in enumerate(todo):
                    if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                        run["stopped_early"], run["not_started"] = True, [p.id for p in todo[index:]]
                        logger.info("time budget of %.0f s reached: %d problems not started", time_budget_s,
                                    len(todo) - index)
                        break
                    entry = {"id": problem.id, "question": problem.question, "gold": problem.answer,
                             "history_tokens": count_tokens(http, small, [*prompt_messages, {
                                 "role": "user", "content": problem.question}]), "conditions": {}}
                    order = list(settings.conditions)
                    shift = len(result["problems"]) % len(order)  # rotated: no condition always runs first
                    for condition in order[shift:] + order[:shift]:
                        entry["conditions"][condition] = run_episode(client, problem, condition, small, large,
                                                                     prompt_messages, settings)
                    entry["conditions"] = {c: entry["conditions"][c] for c in order}
                    result["problems"].append(entry)
                    run["problems_run"] += 1
                    run["wall_s"] = time.monotonic() - started
                    result["summary"] = summarize_agent(result)
                    if out is not None:
                        atomic_write_json(Path(out), result)
                    solved = {c: e["solved"] for c, e in entry["conditions"].items()}
                    logger.info("%s (gold %s): %s", problem.id, format_number(problem.answer), solved)
                    bar.update(1)
                    bar.set_postfix(solved={c: row["solved"] for c, row in result["summary"]["rows"].items()})
        finally:
            client.close()
    run["wall_s"] = time.monotonic() - started
    result["summary"] = summarize_agent(result)
    if out is not None:
        atomic_write_json(Path(out), result)
    return result


def run_agent_bench(models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                    problems: list[Problem] | None = None, count: int = 20, seed: int = 0,
                    settings: AgentSettings = AgentSettings(), **options) -> dict:
    """Serve ``models`` (the first small, the second large) with ``mappers`` on a free loopback port in this process
    and run the agent bench against it (`agent_over_http`'s ``options``); ``problems`` default: `gsm8k_problems`."""
    problems = gsm8k_problems(count, seed) if problems is None else problems
    server = {key: value for key, value in config.to_dict().items()
              if key in ("guard", "guard_signal", "guard_threshold", "handover", "recompute", "max_context")}
    engine = Engine(models, mappers, config)
    with serve_in_thread(engine, host="127.0.0.1") as running:
        return agent_over_http(running.url, problems, settings, seed, server=server, models=list(models), **options)


# -- summary and table ------------------------------------------------------------------------------------------


def _rate_interval(values: np.ndarray, seed: int, resamples: int) -> list[float]:
    return list(paired_bootstrap({"x": values}, lambda s: float(s["x"].mean()), resamples, seed))


def summarize_agent(result: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """Per condition: solve rate with its bootstrap 95% interval, valid tool-call rate, switches, the time to the
    first chunk and the server's report at the switch steps, history at the switches, wall time per problem; and the
    paired difference of solve rates handoff − reprefill over the problems both ran."""
    problems = result["problems"]
    conditions = result["settings"]["conditions"]
    rows = {}
    for index, condition in enumerate(conditions):
        episodes = [p["conditions"][condition] for p in problems if condition in p["conditions"]]
        solved = np.array([e["solved"] for e in episodes], dtype=np.float64)
        answered = [s for e in episodes for s in e["steps"] if not s.get("error")]
        switches = [s for s in answered if s["switch"]]
        ttft = [s["first_chunk_s"] for s in switches if s["first_chunk_s"] is not None]
        server_ms = [s["handoff"]["milliseconds"] for s in switches if s.get("handoff")]
        walls = [e["wall_s"] for e in episodes]
        rows[condition] = {
            "problems": len(episodes),
            "solved": int(solved.sum()),
            "solve_rate": float(solved.mean()) if len(episodes) else None,
            "solve_rate_ci": _rate_interval(solved, seed + index, resamples) if len(episodes) else [None, None],
            "calls": len(answered),
            "valid_calls": sum(s["valid"] for s in answered),
            "valid_call_rate": sum(s["valid"] for s in answered) / len(answered) if answered else None,
            "steps_per_problem": float(np.mean([len(e["steps"]) for e in episodes])) if episodes else None,
            "switches_per_problem": {"min": min((e["switches"] for e in episodes), default=None),
                                     "mean": float(np.mean([e["switches"] for e in episodes])) if episodes
                                     else None},
            "switch_ttft_s": {"median": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95), "n": len(ttft)},
            "switch_server_ms": {"median": percentile(server_ms, 0.5), "p95": percentile(server_ms, 0.95)},
            "switch_status": dict(Counter(s["status"] for s in switches)),
            "switch_history_tokens_median": percentile([s["prompt_tokens"] for s in switches], 0.5),
            "step_ttft_s_median": percentile([s["first_chunk_s"] for s in answered
                                              if s["first_chunk_s"] is not None], 0.5),
            "wall_s_per_problem": {"median": percentile(walls, 0.5),
                                   "mean": float(np.mean(walls)) if walls else None},
            "stopped": dict(Counter(e["stopped"] for e in episodes)),
            "errors": sum(e["stopped"] == "error" for e in episodes),
        }
    summary: dict[str, Any] = {"rows": rows, "confidence": 0.95, "resamples": resamples}
    paired = [p for p in problems if all(c in p["conditions"] for c in SWITCHING)]
    if paired:
        handoff = np.array([p["conditions"]["handoff"]["solved"] for p in paired], dtype=np.float64)
        reprefill = np.array([p["conditions"]["reprefill"]["solved"] for p in paired], dtype=np.float64)
        interval = paired_bootstrap({"a": handoff, "b": reprefill},
                                    lambda s: float(s["a"].mean() - s["b"].mean()), resamples, seed)
        summary["handoff_minus_reprefill"] = {"value": float(handoff.mean() - reprefill.mean()),
                                              "ci": list(interval), "problems": len(paired)}
    return summary


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def agent_table(result: dict) -> str:
    """The summary as a markdown table, with the paired difference and any early stop below it."""
    summary = result.get("summary") or summarize_agent(result)
    models = result["settings"]["models"]
    lines = [f"agent bench: GSM8K, {models['small']} (small) / {models['large']} (large), "
             f"max {result['settings']['max_steps']} steps of {result['settings']['max_tokens']} tokens",
             "",
             "| condition | problems | solve rate [95% CI] | valid calls | switches / problem | TTFT at switches "
             "median / p95 (s) | server ms at switches (median) | statuses at switches | history at switches "
             "(median tokens) | wall s / problem (median) |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for condition, row in summary["rows"].items():
        if row["problems"] == 0:
            lines.append(f"| {condition} | 0 | – | – | – | – | – | – | – | – |")
            continue
        low, high = row["solve_rate_ci"]
        rate = f"{row['solve_rate']:.3f} [{low:.3f}, {high:.3f}]"
        valid = "–" if row["valid_call_rate"] is None else f"{row['valid_call_rate']:.3f}"
        ttft = row["switch_ttft_s"]
        switched = ttft["n"] > 0
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row["switch_status"].items())) or "–"
        history = row["switch_history_tokens_median"]
        server_ms = row["switch_server_ms"]["median"]
        lines.append(
            f"| {condition} | {row['problems']} | {rate} | {valid} | {row['switches_per_problem']['mean']:.1f} | "
            + (f"{_seconds(ttft['median'])} / {_seconds(ttft['p95'])}" if switched else "–")
            + f" | {'–' if server_ms is None else f'{server_ms:.0f}'} | {statuses} | "
            + f"{'–' if history is None else f'{history:.0f}'} | {row['wall_s_per_problem']['median']:.2f} |")
    difference = summary.get("handoff_minus_reprefill")
    if difference:
        low, high = difference["ci"]
        lines += ["", f"solve rate handoff − reprefill: {difference['value']:+.3f} [{low:+.3f}, {high:+.3f}] "
                      f"(paired bootstrap over {difference['problems']} problems)"]
    last = result["runs"][-1] if result.get("runs") else None
    if last and last["stopped_early"]:
        lines += ["", f"time budget reached: {len(last['not_started'])} problem(s) not started (rerun with the same "
                      "--out to continue)"]
    return "\n".join(lines)
