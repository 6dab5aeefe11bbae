"""Token-by-token decoding on a session's cache: the OpenAI/vLLM sampling settings (`SamplingParams`) and the
`Sampler` that applies them to choose each next token, the simpler `choose_token` (greedy, or sampled with
temperature and top-p from a seeded generator), the end-of-text ids, and stop strings in a growing text."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from kvhandoff.errors import ConfigError

# Below this temperature the answer is greedy (as vLLM): dividing by it would overflow the scores to -inf and the
# softmax to NaN, while a sample would be the argmax anyway.
GREEDY_BELOW = 1e-5


def end_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end an answer: the tokenizer's EOS and every id the model's generation config lists."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if configured is not None:
        ids.update([int(configured)] if isinstance(configured, int) else [int(i) for i in configured])
    return frozenset(ids)


#: the sampling fields a model's generation config may set for the requests that leave them out (vLLM's set; its
#: ``max_new_tokens`` becomes the answer limit)
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                            "frequency_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves them out gets: ``sampling``, `SamplingParams` fields by name, and ``max_tokens``
    (None: the server's own limit)."""

    sampling: dict = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None

    def __bool__(self) -> bool:
        return bool(self.sampling) or self.max_tokens is not None


def generation_config_defaults(model, name: str = "the model") -> GenerationDefaults:
    """The sampling settings and answer limit ``model``'s generation config sets, as vLLM serves them under its
    ``--generation-config auto``: the `GENERATION_CONFIG_FIELDS` and ``max_new_tokens`` (as ``max_tokens``) that the
    config gives other than transformers' defaults. Checked here, once: a value a request could not carry is refused
    (ConfigError naming the model and the fix)."""
    config = getattr(model, "generation_config", None)
    if config is None or not callable(getattr(config, "to_diff_dict", None)):
        return GenerationDefaults()
    given = config.to_diff_dict()
    sampling = {key: given[key] for key in GENERATION_CONFIG_FIELDS if given.get(key) is not None}
    max_tokens = given.get("max_new_tokens")
    try:
        SamplingParams(**sampling)
        if max_tokens is not None:
            _integer("max_new_tokens", max_tokens, 1)
    except ConfigError as exc:
        raise ConfigError(f"the generation config of {name}: {exc}; fix its generation_config.json, or serve the "
                          "server's own defaults (--generation-config vllm)") from exc
    return GenerationDefaults(sampling, max_tokens)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by ``seed`` (None: a fresh random seed)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % 2**63)
    return generator


def choose_token(logprobs: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """The next token from log-probs [vocab]: the argmax when ``temperature`` is 0 or below `GREEDY_BELOW` (what
    `generate(do_sample=False)` picks), else a sample from softmax(logprobs / temperature) restricted to the smallest
    set of most likely tokens whose probability reaches ``top_p``."""
    if temperature < GREEDY_BELOW:
        return int(logprobs.argmax())
    return _draw(torch.softmax(logprobs.float().cpu() / temperature, dim=-1), top_p, generator)


def _draw(probs: torch.Tensor, top_p: float, generator: torch.Generator | None) -> int:
    """A token drawn from ``probs`` [vocab] (CPU) restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (always at least the most likely token: a tiny positive top_p is greedy).
    `choose_token` and `Sampler` share it, so that one seed draws the same token in both; transformers'
    TopPLogitsWarper sorts the other way and renormalises, which draws otherwise at the edges."""
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        # the most likely token always stays: a top_p that is 0 in float32 (1e-300) keeps it alone, i.e. greedy
        sorted_probs[1:][before[1:] >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))

def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float if it is a finite number in the interval from ``low`` (excluded with ``low_open``) to
    ``high`` (included), else a ConfigError naming the field, the interval and the value."""
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if number and (low < value if low_open else low <= value) and value <= high:
        return float(value)
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if math.isinf(high) else ']'}"
    raise ConfigError(f"sampling {name} must be a number in {interval}, got {value!r}")


def _integer(name: str, value, low: int, note: str = "") -> int:
    """``value`` if it is an integer ≥ ``low``, else a ConfigError naming the field, the range and the value."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return value
    raise ConfigError(f"sampling {name} must be an integer ≥ {low}{note}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one answer's tokens are chosen, with OpenAI's and vLLM's meanings: ``temperature`` 0 is greedy;
    ``top_k`` 0 or -1 is off; ``min_p`` keeps the tokens at least that share of the most likely one's probability;
    ``repetition_penalty`` (as transformers and vLLM) divides the positive and multiplies the negative scores of every
    token of the prompt and the answer so far; ``presence_penalty`` and ``frequency_penalty`` (as OpenAI) subtract
    from each token's score, over the answer only, ``frequency_penalty * count + presence_penalty * (count > 0)``;
    ``logit_bias`` pairs (token id, bias) add the bias to that token's score; the answer's stop ids cannot be chosen
    before ``min_tokens`` tokens; with ``ignore_eos`` the model's end ids do not end the answer (``stop_token_ids``
    still do); ``seed`` None draws from a fresh random seed. Lists are stored as tuples, and a mapping as
    ``logit_bias``'s pairs. Every field is checked: a ConfigError names the field, its range and the value."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        def store(name, value):  # frozen: normalised values go in through object.__setattr__
            object.__setattr__(self, name, value)

        store("temperature", _number("temperature", self.temperature, 0.0, 2.0))
        store("top_p", _number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        store("top_k", _integer("top_k", self.top_k, -1, " (0 or -1: off)"))
        store("min_p", _number("min_p", self.min_p, 0.0, 1.0))
        store("repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                            low_open=True))
        store("presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        store("frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        store("logit_bias", self._checked_logit_bias())
        store("min_tokens", _integer("min_tokens", self.min_tokens, 0))
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"sampling ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise ConfigError(f"sampling stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        store("stop_token_ids", tuple(_integer("stop_token_ids id", i, 0) for i in self.stop_token_ids))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"sampling seed must be an integer or None, got {self.seed!r}")

    def _checked_logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = self.logit_bias
        if isinstance(pairs, dict):
            pairs = tuple(pairs.items())
        if not isinstance(pairs, tuple | list):
            raise ConfigError(f"sampling logit_bias must be (token id, bias) pairs, got {pairs!r}")
        checked: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ConfigError(f"sampling logit_bias must be (token id, bias) pairs, got {pair!r}")
            token = _integer("logit_bias token id", pair[0], 0)
            if token in checked:
                raise ConfigError(f"sampling logit_bias gives token id {token} twice")
            checked[token] = _number(f"logit_bias bias of token {token}", pair[1], -100.0, 100.0)
        return tuple(checked.items())


def apply_logit_bias(scores: torch.Tensor, logit_bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """``scores`` [..., vocab] with each (token id, bias) pair's bias added to that token's score."""
    if not logit_bias:
        return scores
    ids = torch.tensor([token for token, _ in logit_bias], dtype=torch.long, device=scores.device)
    biases = torch.tensor([bias for _, bias in logit_bias], dtype=scores.dtype, device=scores.device)
    return scores.index_add(-1, ids, biases.expand(*scores.shape[:-1], len(logit_bias)))


def apply_openai_penalties(scores: torch.Tensor, answer: Sequence[int], presence_penalty: float,
                           frequency_penalty: float) -> torch.Tensor:
    """``scores`` [..., vocab] less, for each token, ``frequency_penalty * count + presence_penalty * (count > 0)``
    where count is how often the token occurs in ``answer`` (OpenAI's penalties; the prompt does not count)."""
    if not len(answer) or (presence_penalty == 0 and frequency_penalty == 0):
        return scores
    vocab = scores.shape[-1]
    ids = torch.as_tensor(list(answer), dtype=torch.long, device=scores.device)
    counts = torch.bincount(ids, minlength=vocab)[:vocab].to(scores.dtype)
    return scores - frequency_penalty * counts - presence_penalty * (counts > 0).to(scores.dtype)


class Sampler:
    """Chooses the tokens of one answer under ``params``, for a model of ``vocab_size`` tokens whose end ids are
    ``end_ids``, after ``prompt_ids`` (which the repetition penalty counts). Token ids in ``params`` outside the
    vocabulary are refused here (ConfigError). One generator, seeded by ``params.seed``, serves every draw."""

    def __init__(self, params: SamplingParams, end_ids: frozenset[int], vocab_size: int, prompt_ids: Sequence[int]):
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"Sampler needs SamplingParams, got {type(params).__name__}")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ConfigError(f"Sampler vocab_size must be a positive integer, got {vocab_size!r}")
        named = [("logit_bias", token) for token, _ in params.logit_bias]
        named += [("stop_token_ids", token) for token in params.stop_token_ids]
        for field, token in named:
            if token >= vocab_size:
                raise ConfigError(f"sampling {field} token id {token} is outside the vocabulary 0..{vocab_size - 1}",
                                  field=field)
        self.params = params
        self.vocab_size = vocab_size
        self._stop_ids = frozenset(() if params.ignore_eos else (int(i) for i in end_ids)) | set(params.stop_token_ids)
        self._stop_mask = None
        held = [i for i in self._stop_ids if 0 <= i < vocab_size]  # an end id past the vocabulary is never drawn
        if params.min_tokens > 0 and held:
            self._stop_mask = torch.zeros(vocab_size, dtype=torch.bool)
            self._stop_mask[held] = True
        self._repetition = None
        if params.repetition_penalty != 1.0:
            self._repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
            self._prompt_ids = torch.tensor(sorted({int(i) for i in prompt_ids}), dtype=torch.long)
        self._greedy = params.temperature < GREEDY_BELOW
        self._warpers = []
        if not self._greedy:
            self._warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self._warpers.append(TopKLogitsWarper(params.top_k))
            if params.min_p > 0:
                self._warpers.append(MinPLogitsWarper(params.min_p))
        self.generator = make_generator(params.seed)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end the answer: the model's end ids (none with ``ignore_eos``) and ``stop_token_ids``."""
        return self._stop_ids

    def next_token(self, logprobs: torch.Tensor, answer: Sequence[int], allowed: torch.Tensor | None = None) -> int:
        """The next token from ``logprobs`` [vocab] after ``answer`` (the tokens chosen so far), only among the
        ``allowed`` ones (a bool mask [vocab], e.g. a grammar's) if given. Applied in order: logit bias, repetition
        penalty, presence and frequency penalties, the min_tokens mask of the stop ids, ``allowed``; then the argmax
        at temperature 0, else temperature, top-k, min-p and top-p, and a draw."""
        if logprobs.shape != (self.vocab_size,):
            raise ConfigError(f"Sampler expects log-probs of shape ({self.vocab_size},), got {tuple(logprobs.shape)}")
        params = self.params
        scores = logprobs.float()[None]  # [1, vocab], the shape transformers' processors take
        scores = apply_logit_bias(scores, params.logit_bias)
        if self._repetition is not None:
            # on log-probs (all ≤ 0) it always multiplies; vLLM's raw logits differ by a shift, which only this step
            # (of all here) is not invariant to
            self._prompt_ids = self._prompt_ids.to(scores.device)
            seen = torch.cat([self._prompt_ids, torch.as_tensor(list(answer), dtype=torch.long, device=scores.device)])
            if seen.numel():
                scores = self._repetition(seen[None], scores)
        scores = apply_openai_penalties(scores, answer, params.presence_penalty, params.frequency_penalty)
        scores = self._masked(scores, len(answer), allowed)
        if self._greedy:
            return int(scores.argmax())
        scores = scores.cpu()  # the generator is a CPU one
        for warper in self._warpers:
            scores = warper(None, scores)
        return _draw(torch.softmax(scores[0], dim=-1), params.top_p, self.generator)

    def _masked(self, scores: torch.Tensor, step: int, allowed: torch.Tensor | None) -> torch.Tensor:
        """``scores`` with the stop ids at -inf before ``min_tokens`` tokens and the tokens ``allowed`` refuses at
        -inf. The grammar wins: where both together leave no token, the stop ids stay open."""
        masked = scores
        if self._stop_mask is not None and step < self.params.min_tokens:
            masked = scores.masked_fill(self._stop_mask.to(scores.device), -math.inf)
        if allowed is None:
            return masked if bool((masked > -math.inf).any()) else scores
        allowed = torch.as_tensor(allowed, device=scores.device)
        if allowed.dtype != torch.bool or allowed.shape != (self.vocab_size,):
            raise ConfigError(f"allowed must be a bool mask of shape ({self.vocab_size},), "
                              f"got {allowed.dtype} {tuple(allowed.shape)}")
        for candidate in (masked, scores):
            kept = candidate.masked_fill(~allowed, -math.inf)
            if bool((kept > -math.inf).any()):
                return kept
        raise ConfigError("allowed: the mask leaves no token the model can produce")


def stop_index(text: str, stops, start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or None."""
    found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops) -> int:
    """Characters at the end of ``text`` to hold back while streaming: an incomplete UTF-8 character (decoded as
    U+FFFD) or the beginning of a stop string, which the next tokens may complete."""
    held = 0
    while held < len(text) and text[len(text) - 1 - held] == "\ufffd":
        held += 1
    if not text:
        return held
    last = text[-1]
    for stop in stops:
        size = min(len(stop) - 1, len(text))
        while size > held:  # only the sizes whose prefix of the stop ends with the text's last character
            size = stop.rfind(last, 0, size) + 1
            if size > held and text.endswith(stop[:size]):
                held = size
                break
            size -= 1
    return held


def greedy_answer(session, server: str, logprobs: torch.Tensor, max_new_tokens: int, stop_ids,
                  feed_last: bool = False) -> list[int]:
    """``server`` answers greedily on ``session`` from ``logprobs`` (the distribution after the conversation so
    far), at most ``max_new_tokens`` tokens, stopping before any of ``stop_ids``. Every answer token but the last is
    fed (cached and appended to the session's tokens); the last too with ``feed_last``."""
    answer: list[int] = []
    for step in range(max_new_tokens):
        token = choose_token(logprobs)
        if token in stop_ids:
            break
        answer.append(token)
        if step + 1 < max_new_tokens or feed_last:
            logprobs = session.read_logprobs(server, [token])[-1]
    return answer
