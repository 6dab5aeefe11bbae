"""The selective-recompute policy of a handoff (CacheBlend, arXiv 2405.16444; EPIC, arXiv 2410.15332): which mapped
positions the target recomputes itself.

One small frozen class per rule (`NoRecompute`, `Sinks`, `Recent`, `Deviation`, `Blend`, `SourceAttention`,
`TurnAttention`, `TargetTurnAttention`, `Mix`), each ranking the candidate positions its own way; a policy at a
budget takes the first `budget_count` of its ranking (`RecomputePolicy.positions`); the attention rules may rank whole
blocks of positions (`block_scores`).
`LeadingLayers` recomputes whole layers instead (DroidSpeak, arXiv 2411.02820): the target's first layers at every
mapped position (`RecomputePolicy.leading_layers`). `RULES` names the classes; `parse` reads a spec such as
"recent:5%" — at the edges only (a command-line option, a server's settings, a stored result), so everything below
holds policy objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.deviation import blend_scores, deviation_scores
from kvhandoff.runtime.recompute import source_attention_scores
from kvhandoff.runtime.seam import KVCache, as_kv_cache

#: the budgets (fractions of the mapped history) a retention-vs-speed sweep measures
RECOMPUTE_BUDGETS: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: the default shares of rule "mix"
DEFAULT_RECOMPUTE_MIX: tuple[tuple[str, float], ...] = (("sinks", 0.2), ("recent", 0.3), ("deviation", 0.5))
#: how many of the history's last queries rule "source_attention" reads by default
DEFAULT_WINDOW = 32
#: special tokens that open a chat turn (a role marker); `turn_marker_ids` looks them up in a tokenizer
TURN_MARKERS: tuple[str, ...] = (
    "<|im_start|>", "<|start_header_id|>", "[INST]", "<start_of_turn>", "<|user|>", "<|assistant|>", "<|system|>",
)


@dataclass(frozen=True)
class SelectionInfo:
    """What the rules may know beyond the cache and the tokens.

    start: the first mapped position; positions before it are the target's own (its exact prefix, or the cache it
        kept) and are never selected; the budget is a fraction of the T − start mapped positions.
    turn_starts: positions where a turn begins (shared by the batch), for "sinks".
    marker_ids: token ids that open a turn (e.g. `<|im_start|>`, see `turn_marker_ids`), for "sinks".
    source_attention: [batch, T] attention the source paid each position (`source_attention_scores`).
    new_turn: the token ids the target reads right after the handoff (shared by the batch), for "turn_attention".
    source_turn_read: [batch, T] the attention the source paid each position while it read ``new_turn`` on its
        cache (`recompute.read_turn`'s scores), when the caller read the turn with the source already (a guard's
        reference pass); "turn_attention" without lookahead ranks by it instead of reading the turn again.
    """

    start: int = 0
    turn_starts: tuple[int, ...] = ()
    marker_ids: tuple[int, ...] = ()
    source_attention: torch.Tensor | None = field(default=None, compare=False)
    new_turn: tuple[int, ...] = ()
    source_turn_read: torch.Tensor | None = field(default=None, compare=False)


def turn_marker_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the `TURN_MARKERS` the tokenizer has."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return tuple(vocab[token] for token in TURN_MARKERS if token in vocab)


def budget_count(budget: float, candidates: int) -> int:
    """Positions a budget (fraction of ``candidates``) buys: rounded half up, never more than there are."""
    if not 0 <= budget <= 1:
        raise ConfigError(f"a recompute budget is a fraction in [0, 1], got {budget!r}")
    return min(candidates, math.floor(budget * candidates + 0.5))


def _empty(batch: int, device) -> torch.Tensor:
    return torch.empty(batch, 0, dtype=torch.long, device=device)


def _by_score(scores: torch.Tensor, start: int) -> torch.Tensor:
    """Candidates start..T−1 by descending score [batch, T] (ties: the earlier position first)."""
    order = torch.sort(-scores[:, start:].float(), dim=1, stable=True).indices
    return order + start


def _check_window(window, name: str = "window", zero: bool = False) -> None:
    """``window`` must be a positive integer (``zero``: or 0)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < (0 if zero else 1):
        raise ConfigError(f"recompute {name} must be a {'non-negative' if zero else 'positive'} integer, got "
                          f"{window!r}")


def block_scores(scores: torch.Tensor, start: int, block: int) -> torch.Tensor:
    """[batch, T]: each candidate position start..T−1 scored by the mean of ``scores`` over its block (the
    candidates in runs of ``block`` positions from ``start``; the last run may be shorter), so a ranking by them
    takes whole blocks, the earlier position first within one. Positions before ``start`` keep their scores."""
    if block == 1:
        return scores
    candidates = scores[:, start:].float()
    count = candidates.shape[1]
    padded = torch.nn.functional.pad(candidates, (0, -count % block))
    sums = padded.unflatten(1, (-1, block)).sum(dim=2)
    sizes = torch.full((sums.shape[1],), float(block), device=scores.device)
    sizes[-1] = count - block * (sums.shape[1] - 1)
    means = (sums / sizes).repeat_interleave(block, dim=1)[:, :count]
    return torch.cat([scores[:, :start].float(), means], dim=1)


def covering_count(scores: torch.Tensor, coverage: float) -> int:
    """The fewest top-scored candidates whose scores [batch, n] hold ``coverage`` of each row's total (the most any
    row needs; at least one)."""
    if not scores.shape[1]:
        return 0
    ranked = scores.float().clamp_min(0).sort(dim=1, descending=True).values
    share = ranked.cumsum(dim=1) / ranked.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return int(((share < coverage - 1e-6).sum(dim=1) + 1).clamp_max(scores.shape[1]).max())


def history_reliance(scores: torch.Tensor, start: int) -> torch.Tensor:
    """[batch]: the share of each row's attention over the cached positions (``scores`` [batch, T]) that lands on
    the candidates start..T−1 — how much a read leans on the mapped rows rather than the exact prefix."""
    scores = scores.float().clamp_min(0)
    return scores[:, start:].sum(dim=1) / scores.sum(dim=1).clamp_min(torch.finfo(torch.float32).tiny)


# -- the base --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecomputePolicy:
    """A rule and a ``budget``: the fraction of the mapped positions in [0, 1] the target recomputes (0: nothing;
    1: everything — the target's own prefill, at the cost of one). After the cache is mapped the target runs the
    tokens at the chosen positions through all its layers, at their true positions, and their fresh K/V replace the
    mapped ones (`kvhandoff.runtime.recompute`).

    A subclass names its ``rule`` and ranks the candidates (`rank`); `positions` takes the first of the ranking.
    Written as a spec "RULE:BUDGET" (`spec`; `parse` reads it back).
    """

    budget: float = 0.0
    rule: ClassVar[str]

    def __post_init__(self) -> None:
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 1:
            raise ConfigError(f"recompute budget must be a fraction in [0, 1] of the mapped positions, got {budget!r}")
        object.__setattr__(self, "budget", float(budget))

    @property
    def active(self) -> bool:
        """Whether a handoff under this policy recomputes anything."""
        return self.budget > 0

    @property
    def ceiling(self) -> float:
        """The most of the mapped positions a handoff under this policy may recompute."""
        return self.budget

    @property
    def needs_source_attention(self) -> bool:
        """Whether the policy ranks by the source's attention (the source's queries are recorded at its prefill)."""
        return False

    @property
    def window(self) -> int:
        """How many of the history's last source queries the source's attention is read from."""
        return DEFAULT_WINDOW

    @property
    def reads_new_turn(self) -> bool:
        """Whether the policy's picks depend on the turn the target reads next (`SelectionInfo.new_turn`)."""
        return False

    @property
    def ranks_by_source_turn_read(self) -> bool:
        """Whether a handoff under this policy ranks by the source's read of the new turn alone, so that a read
        the caller made anyway (`SelectionInfo.source_turn_read`) serves it."""
        return False

    @property
    def spec(self) -> str:
        """The policy as a spec string (`parse` reads it back)."""
        if not self.active:
            return "none"
        options = "" if self.window == DEFAULT_WINDOW else f":window={self.window}"
        return f"{self._rule_spec()}:{self.budget * 100:g}%{options}"

    def _rule_spec(self) -> str:
        return self.rule

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        """Every candidate position start..T−1, most wanted first [batch, T − start]."""
        raise NotImplementedError

    def leading_layers(self, num_layers: int) -> int:
        """How many of the target's first layers (of ``num_layers``) it recomputes at every mapped position."""
        return 0

    def positions(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo | None = None,
                  source_model=None, source_cache=None) -> torch.Tensor:
        """The positions [batch, n] (each row sorted; n = `budget_count` of the T − start candidates, or fewer under
        an attention rule's ``coverage``) this policy picks on ``cache`` (the target's mapped rows of ``input_ids``
        [batch, T], as the cache seam exports them), recomputing nothing. Without ``info.source_attention`` a policy
        that needs it reads it from ``source_model`` and ``source_cache`` (`source_attention_scores`; a `KVCache` or
        a `transformers` cache)."""
        info = info or SelectionInfo()
        if not self.active:
            return _empty(input_ids.shape[0], input_ids.device)
        if input_ids.dim() != 2 or not 0 <= info.start < input_ids.shape[1]:
            raise ConfigError(f"input_ids must be [batch, T] with start in 0..T−1, got {tuple(input_ids.shape)} and "
                              f"start {info.start}")
        count = budget_count(self.ceiling, input_ids.shape[1] - info.start)
        if count == 0:
            return _empty(input_ids.shape[0], input_ids.device)
        if self.needs_source_attention and info.source_attention is None:
            if source_model is None or source_cache is None:
                raise ConfigError(f"recompute rule {self.rule!r} needs the source's attention: the source model and "
                                  "its cache (or SelectionInfo.source_attention, from source_attention_scores)")
            scores = source_attention_scores(source_model, _rows(source_cache), input_ids, self.window)
            info = replace(info, source_attention=scores)
        return self._pick(target_model, cache, input_ids, info, count)

    def _pick(self, target_model, cache, input_ids, info: SelectionInfo, count: int) -> torch.Tensor:
        """The first ``count`` (`budget_count` of the ``ceiling``) of the ranking."""
        return self.rank(target_model, cache, input_ids, info)[:, :count].sort(dim=1).values


# -- the rules -------------------------------------------------------------------------------------------------------


def _rows(cache):
    """A cache's rows as a `transformers` cache (a `KVCache` exports them; a `transformers` cache is one)."""
    return cache.export() if isinstance(cache, KVCache) else cache


@dataclass(frozen=True)
class NoRecompute(RecomputePolicy):
    """Nothing recomputed: the target reads the mapped cache as it is (whatever the budget says)."""

    rule: ClassVar[str] = "none"

    @property
    def active(self) -> bool:
        return False


@dataclass(frozen=True)
class Sinks(RecomputePolicy):
    """The first tokens of the context (from `start`) and of every turn, round-robin over the turns: first every turn
    start, then the token after each, and so on."""

    rule: ClassVar[str] = "sinks"

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        batch, total = input_ids.shape
        device = input_ids.device
        ids = torch.arange(total, device=device)
        starts = torch.zeros(batch, total, dtype=torch.bool, device=device)
        starts[:, info.start] = True
        turns = [p for p in info.turn_starts if info.start <= p < total]
        if turns:
            starts[:, turns] = True
        if info.marker_ids:
            starts |= torch.isin(input_ids, torch.tensor(info.marker_ids, device=device)) & (ids >= info.start)
        segment = torch.where(starts, ids, -1).cummax(dim=1).values  # the latest turn start at or before each position
        offset = ids - segment
        return _by_score(-(offset * total + ids).double(), info.start)


@dataclass(frozen=True)
class Recent(RecomputePolicy):
    """The latest tokens first."""

    rule: ClassVar[str] = "recent"

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        batch, total = input_ids.shape
        return torch.arange(start=total - 1, end=info.start - 1, step=-1, device=input_ids.device).expand(batch, -1)


@dataclass(frozen=True)
class Deviation(RecomputePolicy):
    """The positions whose mapped K/V at the target's layer 0 deviate most from its own (`deviation_scores`)."""

    rule: ClassVar[str] = "deviation"

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        return _by_score(deviation_scores(target_model, cache, input_ids).to(input_ids.device), info.start)


@dataclass(frozen=True)
class Blend(RecomputePolicy):
    """The positions whose cached K/V deviate most from the target's own at its first context-dependent layer, the
    layers below computed over the whole context (`blend_scores`; CacheBlend): what a changed context changed most,
    e.g. a run reused after another beginning (`kvhandoff.runtime.offset`)."""

    rule: ClassVar[str] = "blend"

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        return _by_score(blend_scores(target_model, cache, input_ids).to(input_ids.device), info.start)


@dataclass(frozen=True)
class SourceAttention(RecomputePolicy):
    """The positions the source's last ``window`` queries attended to most (``info.source_attention``,
    `source_attention_scores`). ``block`` > 1 ranks whole blocks of that many positions by their mean attention
    (`block_scores`) instead: a passage the turn reads is recomputed together, not only its most attended tokens.

    ``coverage`` < 1: the budget is a ceiling, and a switch recomputes only as many of the top positions as hold
    that share of the attention the candidates received (the most any row of the batch needs): a turn that reads
    one passage gets that passage, a turn that reads little of the history recomputes little.

    ``escalate`` > 0 (with ``reliance``): a switch whose read leans on the mapped rows — at least ``reliance`` of its
    attention over the cached positions on the candidates (`history_reliance`, any row of the batch) — recomputes
    ``escalate`` of them instead of ``budget``: a turn about a passage of the history gets the larger budget."""

    source_window: int = DEFAULT_WINDOW
    block: int = 1
    coverage: float = 1.0
    reliance: float = 0.0
    escalate: float = 0.0
    rule: ClassVar[str] = "source_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_window(self.source_window)
        _check_window(self.block, "block")
        coverage = self.coverage
        if isinstance(coverage, bool) or not isinstance(coverage, int | float) or not 0 < coverage <= 1:
            raise ConfigError(f"recompute coverage must be a fraction in (0, 1] of the attention the candidates "
                              f"received, got {coverage!r}")
        object.__setattr__(self, "coverage", float(coverage))
        self._check_escalation()

    def _check_escalation(self) -> None:
        reliance, escalate = self.reliance, self.escalate
        for name, value in (("reliance", reliance), ("escalate", escalate)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ConfigError(f"recompute {name} must be a fraction in [0, 1], got {value!r}")
        if (reliance > 0) != (escalate > 0):
            raise ConfigError("recompute escalate=BUDGET and reliance=SHARE go together (the larger budget and the "
                              f"share of the read on the mapped rows that earns it), got reliance={reliance!r} and "
                              f"escalate={escalate!r}")
        if escalate and escalate <= self.budget:
            raise ConfigError(f"recompute escalate must be a larger budget than {self.budget:g}, got {escalate!r}")
        object.__setattr__(self, "reliance", float(reliance))
        object.__setattr__(self, "escalate", float(escalate))

    @property
    def active(self) -> bool:
        return self.budget > 0 or self.escalate > 0

    @property
    def ceiling(self) -> float:
        return max(self.budget, self.escalate)

    @property
    def spec(self) -> str:
        spec = super().spec
        if self.active and self.block != 1:
            spec = f"{spec}:block={self.block}"
        if self.active and self.coverage != 1:
            spec = f"{spec}:coverage={self.coverage * 100:g}%"
        if self.escalate:
            spec = f"{spec}:reliance={self.reliance * 100:g}%:escalate={self.escalate * 100:g}%"
        return spec

    def escalates(self, scores: torch.Tensor, start: int) -> bool:
        """Whether a read with these ``scores`` [batch, T] earns the ``escalate`` budget."""
        return bool(self.escalate) and bool((history_reliance(scores, start) >= self.reliance).any())

    def _pick(self, target_model, cache, input_ids, info: SelectionInfo, count: int) -> torch.Tensor:
        if self.escalate and not self.escalates(info.source_attention.to(input_ids.device), info.start):
            count = budget_count(self.budget, input_ids.shape[1] - info.start)
            if count == 0:
                return _empty(input_ids.shape[0], input_ids.device)
        if self.coverage < 1:
            count = min(count, covering_count(block_scores(info.source_attention.to(input_ids.device), info.start,
                                                           self.block)[:, info.start:], self.coverage))
        return super()._pick(target_model, cache, input_ids, info, count)

    @property
    def needs_source_attention(self) -> bool:
        return True

    @property
    def window(self) -> int:
        return self.source_window

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        if info.source_attention is None:
            raise ConfigError("rule 'source_attention' needs the source's attention (SelectionInfo.source_attention, "
                              "from source_attention_scores); hand off with the source model and its cache")
        scores = block_scores(info.source_attention.to(input_ids.device), info.start, self.block)
        return _by_score(scores, info.start)


@dataclass(frozen=True)
class TurnAttention(SourceAttention):
    """The positions the source attends to most while it reads the new turn (``info.new_turn``) on its cache
    (`KVCache.read_turn`, in the source's engine): what the turn the target reads next is about. Without a new
    turn, the source's last ``window`` queries of the history rank them (as `SourceAttention`; a `transformers`
    source only). ``lookahead`` > 0: the source also answers that many tokens greedily after the turn, and its
    answer's attention counts too."""

    lookahead: int = 0
    rule: ClassVar[str] = "turn_attention"
    #: whether the model that reads the new turn is the source (`_reader`)
    _reads_with_source: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_window(self.lookahead, "lookahead", zero=True)

    @property
    def spec(self) -> str:
        spec = super().spec
        return spec if self.lookahead == 0 or not self.active else f"{spec}:lookahead={self.lookahead}"

    @property
    def needs_source_attention(self) -> bool:
        return False  # its own scores, from the new turn: `positions` reads them

    @property
    def reads_new_turn(self) -> bool:
        return True

    @property
    def ranks_by_source_turn_read(self) -> bool:
        return self.active and self.lookahead == 0 and self._reads_with_source

    def _reader(self, target_model, cache, input_ids: torch.Tensor, source_model, source_cache):
        """The model that reads the new turn and the cache it reads it on (behind the cache seam): the source, on
        its own cache."""
        if source_model is None or source_cache is None:
            raise ConfigError(f"recompute rule {self.rule!r} needs the source model and its cache (the source "
                              "reads the new turn on it)")
        source_cache = as_kv_cache(source_cache)
        if source_cache.length != input_ids.shape[1]:
            raise ConfigError(f"the source cache holds {source_cache.length} positions, input_ids "
                              f"{input_ids.shape[1]}")
        return source_model, source_cache

    def positions(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo | None = None,
                  source_model=None, source_cache=None) -> torch.Tensor:
        """As `RecomputePolicy.positions`; the turn is read on ``source_cache`` (``cache`` for
        `TargetTurnAttention`) in its own engine (`KVCache.read_turn`)."""
        info = info or SelectionInfo()
        if self.active and info.source_attention is None:
            model, read_on = self._reader(target_model, cache, input_ids, source_model, source_cache)
            if info.new_turn and info.source_turn_read is not None and self.ranks_by_source_turn_read:
                scores = info.source_turn_read
                if tuple(scores.shape) != tuple(input_ids.shape):
                    raise ConfigError(f"SelectionInfo.source_turn_read is {tuple(scores.shape)}, input_ids "
                                      f"{tuple(input_ids.shape)}: the source's read of the new turn must cover "
                                      "every position of the conversation")
            elif info.new_turn:
                turn = torch.tensor([list(info.new_turn)] * input_ids.shape[0], device=input_ids.device)
                scores = read_on.read_turn(model, turn, 1, self.lookahead).scores
            elif read_on.reads_history_queries:
                scores = source_attention_scores(model, _rows(read_on), input_ids, self.window)
            else:
                raise ConfigError(f"recompute rule {self.rule!r} without a new turn ranks by the last queries of "
                                  f"the history, which a {type(read_on).__name__} does not read: give the new turn "
                                  "(SelectionInfo.new_turn; a SwitchingSession passes the turn it reads)")
            info = replace(info, source_attention=scores)
        return super().positions(target_model, cache, input_ids, info, source_model, source_cache)


@dataclass(frozen=True)
class TargetTurnAttention(TurnAttention):
    """The positions the target attends to most while it reads the new turn on the cache it was handed (mapped),
    before any recompute (`KVCache.read_turn` with the target): what the turn needs, as the model that answers
    it reads it. ``lookahead``: the target also answers that many tokens on the mapped cache. Without a new turn,
    the target's last ``window`` queries of the history, read again on the mapped cache, rank the positions."""

    rule: ClassVar[str] = "target_turn_attention"
    _reads_with_source: ClassVar[bool] = False

    def _reader(self, target_model, cache, input_ids: torch.Tensor, source_model, source_cache):
        if target_model is None or cache is None:
            raise ConfigError(f"recompute rule {self.rule!r} needs the target model and the mapped cache")
        return target_model, as_kv_cache(cache)


@dataclass(frozen=True)
class Mix(RecomputePolicy):
    """Shares of the other rules: each rule of ``shares`` ((rule, share) pairs, shares > 0 summing to 1) takes its
    share of the budget (largest remainders round) from its ranking, skipping what the rules before it took.
    ``source_window``: as in `SourceAttention`, for a share of "source_attention"."""

    shares: tuple[tuple[str, float], ...] = DEFAULT_RECOMPUTE_MIX
    source_window: int = DEFAULT_WINDOW
    rule: ClassVar[str] = "mix"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_window(self.source_window)
        try:
            shares = tuple((str(rule), float(share)) for rule, share in self.shares)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"recompute mix shares are (rule, share) pairs, got {self.shares!r}") from exc
        object.__setattr__(self, "shares", shares)
        names = [rule for rule, _ in shares]
        if not shares or any(name not in _MIXABLE for name in names) or len(set(names)) != len(names):
            raise ConfigError(f"recompute mix must name distinct rules among {', '.join(_MIXABLE)}, got "
                              f"{self.shares!r}")
        if any(not share > 0 for _, share in shares):
            raise ConfigError(f"recompute mix shares must be positive, got {self.shares!r}")
        if abs(sum(share for _, share in shares) - 1) > 1e-6:
            raise ConfigError(f"recompute mix shares must sum to 1, got {self.shares!r}")

    @property
    def needs_source_attention(self) -> bool:
        return any(rule == SourceAttention.rule for rule, _ in self.shares)

    @property
    def window(self) -> int:
        return self.source_window

    def _rule_spec(self) -> str:
        if self.shares == DEFAULT_RECOMPUTE_MIX:
            return self.rule
        return f"{self.rule}(" + ",".join(f"{name}={share:g}" for name, share in self.shares) + ")"

    def _parts(self) -> list[RecomputePolicy]:
        return [RULES[name](1.0) for name, _ in self.shares]

    def _pick(self, target_model, cache, input_ids, info: SelectionInfo, count: int) -> torch.Tensor:
        batch, total = input_ids.shape
        exact = [share * count for _, share in self.shares]
        quotas = [math.floor(q) for q in exact]
        for i in sorted(range(len(quotas)), key=lambda i: quotas[i] - exact[i])[: count - sum(quotas)]:
            quotas[i] += 1
        parts = self._parts()
        rows = []
        for row in range(batch):
            taken = torch.zeros(total, dtype=torch.bool, device=input_ids.device)
            row_info = info if info.source_attention is None else replace(
                info, source_attention=info.source_attention[row : row + 1])
            for part, quota in zip(parts, quotas, strict=True):
                if quota == 0:
                    continue
                ranking = part.rank(target_model, cache, input_ids[row : row + 1], row_info)[0]
                fresh = ranking[~taken[ranking]][:quota]
                taken[fresh] = True
            rows.append(taken.nonzero().flatten())
        return torch.stack(rows)


@dataclass(frozen=True)
class LeadingLayers(RecomputePolicy):
    """Whole layers instead of positions: the target recomputes its first `leading_layers` layers (the budget is
    the fraction of its layers, `budget_count` of them) at every mapped position, and the layers above keep the
    mapped K/V; it costs about that fraction of a prefill of the mapped positions
    (`kvhandoff.runtime.recompute.leading_layer_rows`). A layer's own K/V need the layers below it, so the layers
    recomputed are the first ones. Picks no positions."""

    rule: ClassVar[str] = "layers"

    def leading_layers(self, num_layers: int) -> int:
        return budget_count(self.budget, num_layers) if self.active else 0

    def rank(self, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
        return _empty(input_ids.shape[0], input_ids.device)

    def _pick(self, target_model, cache, input_ids, info: SelectionInfo, count: int) -> torch.Tensor:
        return _empty(input_ids.shape[0], input_ids.device)


#: the recompute rules by name: the one registry `parse` and `policy_for` read
RULES: dict[str, type[RecomputePolicy]] = {
    policy.rule: policy for policy in (NoRecompute, Sinks, Recent, Deviation, SourceAttention, Mix, LeadingLayers,
                                       TurnAttention, TargetTurnAttention, Blend)
}
#: the rules a "mix" may share its budget between: those that rank positions
_MIXABLE = tuple(name for name, kind in RULES.items()
                 if not issubclass(kind, NoRecompute | Mix | LeadingLayers | TurnAttention))

#: the handoffs' default selective-recompute policy: the target recomputes the last 5% of the mapped positions.
#: Chosen on the switch benchmark's dev pool (docs/RESULTS.md "Switch benchmark").
DEFAULT_RECOMPUTE: RecomputePolicy = Recent(0.05)


def policy_for(rule: str, budget: float = 0.0, **options) -> RecomputePolicy:
    """The policy of rule ``rule`` (a name in `RULES`) at ``budget``; options: ``shares`` ("mix"), ``window``
    ("source_attention", the two turn-attention rules, "mix"), ``block`` ("source_attention", the two turn-attention
    rules), ``coverage``, ``reliance`` and ``escalate`` (the same three), ``lookahead`` (the two turn-attention
    rules). ConfigError for an unknown rule or an option the rule lacks."""
    if rule not in RULES:
        raise ConfigError(f"recompute rule must be one of {', '.join(RULES)}, got {rule!r}")
    kind = RULES[rule]
    if "window" in options:
        if not issubclass(kind, SourceAttention | Mix):
            raise ConfigError(f"recompute rule {rule!r} takes no window (only source_attention, turn_attention, "
                              "target_turn_attention and mix do)")
        options["source_window"] = options.pop("window")
    if "block" in options and not issubclass(kind, SourceAttention):
        raise ConfigError(f"recompute rule {rule!r} takes no block (only source_attention, turn_attention and "
                          "target_turn_attention do)")
    for name in ("coverage", "reliance", "escalate"):
        if name in options and not issubclass(kind, SourceAttention):
            raise ConfigError(f"recompute rule {rule!r} takes no {name} (only source_attention, turn_attention and "
                              "target_turn_attention do)")
    if "lookahead" in options and not issubclass(kind, TurnAttention):
        raise ConfigError(f"recompute rule {rule!r} takes no lookahead (only turn_attention and "
                          "target_turn_attention do)")
    try:
        return kind(budget, **options)
    except TypeError as exc:
        raise ConfigError(f"recompute rule {rule!r} takes no option {', '.join(options)}") from exc


#: the options a spec may add after its budget, each "NAME=N" (`policy_for` says which rules take which)
_OPTIONS = ("window", "block", "lookahead")
#: the options whose value is a fraction or a percentage
_FRACTION_OPTIONS = ("coverage", "reliance", "escalate")


def parse(spec: str | RecomputePolicy) -> RecomputePolicy:
    """A policy from a spec "RULE:BUDGET[:window=N][:block=N][:lookahead=N][:coverage=SHARE]
    [:reliance=SHARE:escalate=BUDGET]" (budgets and shares a fraction "0.1" or a percentage "10%"; rule
    "mix(RULE=SHARE,...)" for other shares; "none" alone), or a policy as it is. For the edges: a command-line
    option, a server's settings, a stored result. ConfigError otherwise."""
    if isinstance(spec, RecomputePolicy):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"a recompute policy is a spec such as 'deviation:10%', got {spec!r}")
    text = spec.strip()
    if text in ("none", ""):
        return NoRecompute()
    head, sep, rest = text.partition(":")
    if not sep:
        raise ConfigError(f"recompute spec {spec!r} must be RULE:BUDGET (e.g. 'deviation:10%', 'recent:0.05') "
                          "or 'none'")
    budget_text, *option_texts = rest.split(":")
    options: dict = {}
    for option in option_texts:
        key, _, value = option.partition("=")
        key = key.strip()
        if key in _FRACTION_OPTIONS and key not in options:
            options[key] = _fraction(value, spec, key)
            continue
        if key not in _OPTIONS or key in options or not value.strip().isdigit():
            raise ConfigError(f"recompute spec {spec!r}: options are {', '.join(f'{name}=N' for name in _OPTIONS)}, "
                              "coverage=SHARE, reliance=SHARE and escalate=BUDGET, each at most once, got "
                              + repr(option))
        options[key] = int(value)
    rule = head.strip()
    if rule.startswith("mix(") and rule.endswith(")"):
        try:
            parts = [part.split("=") for part in rule[4:-1].split(",")]
            options["shares"] = tuple((name.strip(), float(share)) for name, share in parts)
        except ValueError as exc:
            raise ConfigError(f"recompute spec {spec!r}: mix shares are RULE=SHARE,... ({exc})") from exc
        rule = Mix.rule
    return policy_for(rule, _fraction(budget_text, spec, "budget"), **options)


def _fraction(text: str, spec: str, what: str) -> float:
    """A spec's fraction "0.1" or percentage "10%"."""
    text = text.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError as exc:
        raise ConfigError(f"recompute spec {spec!r}: the {what} must be a fraction or a percentage, got "
                          f"{text!r}") from exc
