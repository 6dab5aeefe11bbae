"""The product's face: a short real conversation on a model pair through `SwitchingSession`.

The opening model answers a routine turn, the conversation switches to the other model for a hard turn, and back.
At each switch the handoff — the receiving model reads the new turn itself on top of the mapped history, what the
README recommends — is timed against the receiving model re-prefilling the whole conversation, back to back in one
process, and both answers are kept. One extra row shows the paper's condition at the first switch: the source
read the new question too, so the whole context is mapped and the receiving model reads only its last token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.coqa import DEMO_STORY_ID, coqa_conversation
from kvhandoff.errors import ConfigError
from kvhandoff.model.loading import end_of_text_ids
from kvhandoff.model.placement import ModelPlacement
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan, recorded_plans
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.workflow import NamedPair, describe_fit, load_named_pair, load_pair_mapper, obtain_mapper
from kvhandoff.workflow.pair_mappers import on_source_device

logger = logging.getLogger(__name__)

#: a switch saves little on a short context, so the demo's story must be at least this long (in tokens)
MIN_STORY_TOKENS = 1000
SYSTEM_PROMPT = "Answer the question about the story in a few words."

#: how the receiving model got the conversation at a switch (`Switch.condition`)
TURN_BOUNDARY = "turn boundary"  # the history mapped, the new turn read by the receiving model
QUESTION_MAPPED = "question mapped too"  # the paper's condition: the source had read the new question as well


@dataclass(frozen=True)
class Question:
    text: str
    reference: str  # the answer the story gives


@dataclass(frozen=True)
class Script:
    """What the demo talks about: a story and the questions asked about it, one per turn; the models take turns,
    the first one opening."""

    title: str
    story: str
    questions: tuple[Question, ...]


#: routine, hard (a count the story gives once, near its end, next to another count), routine
DEMO_QUESTIONS = (
    Question("What was the man's name?", "Henry"),
    Question("How many of Henry's friends still come to the dance?", "only two now"),
    Question("Who are Henry's two friends?", "Tom and Joe"),
)


def demo_script() -> Script:
    """The default script: `DEMO_QUESTIONS` on the CoQA story `DEMO_STORY_ID` from the shipped data package."""
    story = coqa_conversation(DEMO_STORY_ID).story
    return Script(f"CoQA story {DEMO_STORY_ID}", story, DEMO_QUESTIONS)


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: tuple[int, ...]
    ttft_seconds: float  # from the call to the first new token: the switch, the forward that reads the turn


@dataclass(frozen=True)
class Switch:
    """One switch of the conversation, the handoff beside the receiving model's re-prefill of the same tokens."""

    turn: int  # 1-based
    source: str
    target: str
    condition: str  # TURN_BOUNDARY or QUESTION_MAPPED
    mapped_tokens: int  # positions mapped for the target at this switch
    read_tokens: int  # tokens the target reads itself before it answers
    handoff: Answer
    reprefill: Answer
    recompute: str  # the spec of the recompute policy the switch ran under

    @property
    def speedup(self) -> float:
        return self.reprefill.ttft_seconds / self.handoff.ttft_seconds

    @property
    def same_answer(self) -> bool:
        return self.handoff.token_ids == self.reprefill.token_ids


@dataclass(frozen=True)
class TurnRecord:
    turn: int  # 1-based
    model: str
    question: Question
    answer: Answer  # the answer that joined the conversation (after the handoff, at a switch)
    context_tokens: int  # the conversation the model answered, the new turn included


@dataclass(frozen=True)
class MapperUse:
    source: str
    target: str
    folder: str
    reused: bool  # loaded from the cache or a saved folder, not fitted in this run
    fit: str  # `workflow.describe_fit`


@dataclass(frozen=True)
class DemoResult:
    source: str  # opens the conversation
    target: str  # takes the hard turn
    mappers: tuple[MapperUse, ...]
    story: str  # the script's title
    story_tokens: int
    turns: tuple[TurnRecord, ...]
    switches: tuple[Switch, ...]  # at the turn boundaries in turn order, then the paper's condition

    def to_dict(self) -> dict:
        data = asdict(self)
        for row, switch in zip(data["switches"], self.switches, strict=True):
            row["speedup"] = switch.speedup
        return data


def run_demo(
    source_spec: str,
    target_spec: str,
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen
    calibration: CalibrationSpec = CalibrationSpec(),  # noqa: B008 - frozen
    max_new_tokens: int = 32,
    progress: bool = True,
    refit: bool = False,
    mapper_path: str | Path | None = None,
    reverse_mapper_path: str | Path | None = None,
    recompute=None,
    placement: ModelPlacement = ModelPlacement(),  # noqa: B008 - frozen
    script: Script | None = None,
    min_story_tokens: int = MIN_STORY_TOKENS,
) -> DemoResult:
    """Load the pair, fit or reuse a mapper each way, and hold the `script`'s conversation (default `demo_script`):
    ``source_spec`` opens it and serves every other turn, ``target_spec`` the turns between.

    mapper_path / reverse_mapper_path: a saved mapper of source → target / target → source (e.g. a refined one)
    instead of the pair's default, which is fitted (one calibration pass serves both directions) or reused from the
    cache under `config` and `calibration`. recompute: the handoffs' selective-recompute policy (a `RecomputePolicy`
    or a spec; None: each pair's policy recorded with its mapper, else the default). placement: the models' dtype
    and device map.
    """
    if source_spec == target_spec:
        raise ConfigError(f"the demo switches between two models; both are {source_spec!r}")
    script = script or demo_script()
    pair = load_named_pair(source_spec, target_spec, placement.dtype, progress, device_map=placement.device_map)
    story_tokens = check_story(pair.tokenizer, script, min_story_tokens)  # before a fit that may take long
    forward = _pair_mapper(pair, mapper_path, config, calibration, progress, refit)
    backward = _pair_mapper(pair.reversed(), reverse_mapper_path, config, calibration, progress, refit)
    models = {source_spec: pair.source, target_spec: pair.target}
    mappers = {(source_spec, target_spec): forward[0], (target_spec, source_spec): backward[0]}
    turns, switches = converse(models, mappers, pair.tokenizer, script, max_new_tokens, recompute)
    return DemoResult(source_spec, target_spec, (forward[1], backward[1]), script.title, story_tokens, turns,
                      switches)


def _pair_mapper(pair: NamedPair, folder, config, calibration, progress: bool, refit: bool):
    """(mapper, `MapperUse`) of the pair's direction: the saved one in ``folder``, else the cached default."""
    if folder is not None:
        mapper, reused = load_pair_mapper(folder, pair), True
    else:
        mapper, folder, reused = obtain_mapper(pair, config, calibration, progress, refit, both_directions=True)
    on_source_device(mapper, pair.source)
    return mapper, MapperUse(pair.source_spec, pair.target_spec, str(folder), reused, describe_fit(mapper))


def check_story(tokenizer, script: Script, min_tokens: int = MIN_STORY_TOKENS) -> int:
    """The story's length in tokens; ConfigError when it is shorter than ``min_tokens``, when the script has no
    switch (fewer than two questions), or when the tokenizer has no chat template to render the turns."""
    if len(script.questions) < 2:
        raise ConfigError(f"the demo needs at least two questions (one switch), got {len(script.questions)}")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template: the demo renders its turns as a chat")
    length = len(tokenizer(script.story, add_special_tokens=False)["input_ids"])
    if length < min_tokens:
        raise ConfigError(f"the story has {length} tokens; the demo needs at least {min_tokens} (a switch saves "
                          f"little on a short context)")
    return length


@torch.inference_mode()
def converse(models: dict, mappers: dict, tokenizer, script: Script, max_new_tokens: int = 32,
             recompute=None) -> tuple[tuple[TurnRecord, ...], tuple[Switch, ...]]:
    """Hold the script's conversation: the models (name → model, the first opens) take turns, switching through a
    `SwitchingSession` with ``mappers`` ((from, to) → `Mapper`). Greedy answers of at most ``max_new_tokens``,
    ended by the tokenizer's end-of-text tokens. Returns the turns and the switches (see `DemoResult`)."""
    names = list(models)
    generation = _generation_settings(tokenizer, max_new_tokens)
    session = _session(models, mappers, recompute)
    turns: list[TurnRecord] = []
    at_boundaries: list[Switch] = []
    question_mapped: list[Switch] = []
    answers: list[str] = []
    for index, question in enumerate(script.questions):
        server = names[index % len(names)]
        full = chat_ids(tokenizer, chat_messages(script, answers))
        if index == 0:
            _warm_up(models, full)
        new = _new_turn(session, full)
        if session.owner in (None, server):
            answer = _timed_generate(session, server, new, tokenizer, generation)
        else:
            rows = _measure_switch(session, models[server], server, index + 1, full, new, tokenizer, generation,
                                   paper=not question_mapped)
            at_boundaries.append(rows[0])
            question_mapped += rows[1:]
            answer = rows[0].handoff
        logger.info("turn %d (%s): %s", index + 1, server, answer.text)
        turns.append(TurnRecord(index + 1, server, question, answer, len(full)))
        answers.append(tokenizer.decode(list(answer.token_ids), skip_special_tokens=True))
    return tuple(turns), (*at_boundaries, *question_mapped)


def _measure_switch(session: SwitchingSession, model, server: str, turn: int, full: list[int], new: list[int],
                    tokenizer, generation: dict, paper: bool) -> list[Switch]:
    """The switch to ``server`` for the new turn ``new`` (``full``: the whole conversation with it), back to back:
    ``server`` re-prefilling ``full`` on its own, then (``paper``) the paper's condition on a copy of the session,
    then the handoff, which carries the conversation on. Returns the turn-boundary row, then the paper's."""
    source = session.owner
    mapped = len(session.tokens) - session.cached_length(server)
    recompute = session.plan_for(source, server).recompute.spec
    reprefill = _timed_generate(_session({server: model}, {}, None), server, full, tokenizer, generation)
    rows = []
    if paper:
        answer = _question_mapped(session, source, server, new, tokenizer, generation)
        rows.append(Switch(turn, source, server, QUESTION_MAPPED, mapped + len(new) - 1, 1, answer, reprefill,
                           recompute))
    handoff = _timed_generate(session, server, new, tokenizer, generation)
    return [Switch(turn, source, server, TURN_BOUNDARY, mapped, len(new), handoff, reprefill, recompute), *rows]


def chat_messages(script: Script, answers: list[str]) -> list[dict]:
    """The chat so far — the script's questions with their ``answers`` — and the next question as the new user turn
    (the story comes with the first question)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for index, question in enumerate(script.questions[: len(answers) + 1]):
        text = f"{script.story}\n\n{question.text}" if index == 0 else question.text
        messages.append({"role": "user", "content": text})
        if index < len(answers):
            messages.append({"role": "assistant", "content": answers[index]})
    return messages


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` in the tokenizer's chat template, ready for the assistant's answer (as the
    server renders a chat request)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _new_turn(session: SwitchingSession, full: list[int]) -> list[int]:
    """The tokens of ``full`` (the whole conversation, rendered) past what the session holds. Where an answer
    renders to other tokens than were generated, the session is cut back to the tokens both agree on, as a server
    does with a chat request."""
    shared = 0
    for held, rendered in zip(session.tokens, full, strict=False):
        if held != rendered:
            break
        shared += 1
    if shared < len(session.tokens):
        session.truncate(shared)
    return full[shared:]


# -- the calls into the runtime, kept together ----------------------------------------------------------------------
def _session(models: dict, mappers: dict, recompute) -> SwitchingSession:
    """The demo's session: every pair under ``recompute`` when one is given, else each pair under the policy
    recorded with its mapper (the default where none is), as `kvhandoff serve` hands it over."""
    if recompute is not None:
        return SwitchingSession(models, mappers, plan=HandoffPlan.of(recompute=recompute))
    return SwitchingSession(models, mappers, pair_plans=recorded_plans(DEFAULT_PLAN, mappers))


def _question_mapped(session: SwitchingSession, source: str, target: str, new: list[int], tokenizer,
                     generation: dict) -> Answer:
    """The paper's condition on a copy of the session: ``source`` reads the new turn but its last token (before the
    switch, not timed), then ``target`` is handed everything and reads that last token."""
    twin = session.fork()
    twin.read(source, new[:-1])
    return _timed_generate(twin, target, new[-1:], tokenizer, generation)


def _timed_generate(session: SwitchingSession, server: str, ids: list[int], tokenizer, generation: dict) -> Answer:
    """``server`` reads ``ids`` and answers (`SwitchingSession.generate`: a switch first when another model served
    last); the time to its first new token is taken by the decoding loop's streamer."""
    clock = FirstTokenClock()
    started = time.perf_counter()
    token_ids = session.generate(server, ids, streamer=clock, **generation)
    text = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
    return Answer(text, tuple(token_ids), clock.first_token_at - started)


class FirstTokenClock(BaseStreamer):
    """A `generate` streamer that notes when the first new token comes out (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at = float("nan")

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _generation_settings(tokenizer, max_new_tokens: int) -> dict:
    """Greedy decoding that ends at any of the tokenizer's end-of-text tokens (a chat turn ends at its EOS)."""
    ends = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    ends += [i for i in end_of_text_ids(tokenizer) if i not in ends]
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": ends or None,
            "pad_token_id": ends[0] if ends else None}


def _warm_up(models: dict, ids: list[int]) -> None:
    """One short forward per model, so no timed path pays a model's first-call costs."""
    for model in models.values():
        model(input_ids=torch.tensor([ids[:8]], device=model.device))
