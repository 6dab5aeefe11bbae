"""Constrained decoding for structured output and forced tool calls: what an answer must look like (a grammar spec,
validated when built) and one answer's grammar state, which says which tokens may come next.

The specs compile to llguidance grammars (a CPU engine); JSON is written compact with the separators of Python's
`json.dumps` (``", "`` and ``": "``), as the chat templates write tool calls. Tool calls take the Hermes/Qwen2.5 form
``<tool_call>\\n{"name": "<function>", "arguments": {...}}\\n</tool_call>``, several separated by ``"\\n"``. The
tokenizer's end-of-text tokens end a grammar.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.serving.tools import check_schema_bounds

#: llguidance's JSON options: no free whitespace (a random or confused model cannot pad forever), json.dumps' separators
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_LOCK = threading.Lock()
_VOCABS: dict[tuple[int, int, tuple[int, ...]], _Vocab] = {}
_SHIFTS = torch.arange(32, dtype=torch.int32)
_TOOL_TAGS = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class _Vocab:
    """A tokenizer as the grammars see it: llguidance's conversion, and a bitmask (32 ids per int32 word, lowest bit
    first) of the ids a grammar may ever allow."""

    tokenizer: object  # kept, so that the id in the cache key stays its own
    converted: llguidance.LLTokenizer
    usable: torch.Tensor


def _usable_words(tokenizer, vocab_size: int) -> torch.Tensor:
    """The bitmask of ids that are real tokens: not past the tokenizer's vocabulary, and not the "[PAD<id>]"
    entries a GGUF conversion pads the vocabulary to the model's size with (plain text to llguidance)."""
    words = (vocab_size + 31) // 32
    usable = torch.zeros(words * 32, dtype=torch.bool)
    usable[: min(len(tokenizer), vocab_size)] = True
    padding = [i for token, i in tokenizer.get_vocab().items() if i < vocab_size and token == f"[PAD{i}]"]
    usable[padding] = False
    packed = (usable.view(words, 32).to(torch.int64) << _SHIFTS.to(torch.int64)).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _vocab(tokenizer, vocab_size: int, eos: Iterable[int] | None) -> _Vocab:
    ends = tuple(sorted({int(i) for i in eos})) if eos is not None else ()
    if not ends and getattr(tokenizer, "eos_token_id", None) is not None:
        ends = (int(tokenizer.eos_token_id),)
    key = (id(tokenizer), int(vocab_size), ends)
    with _LOCK:
        cached = _VOCABS.get(key)
        if cached is not None and cached.tokenizer is tokenizer:
            return cached
        try:
            converted = llguidance.hf.from_tokenizer(tokenizer, n_vocab=int(vocab_size),
                                                     eos_token=list(ends) if ends else None)
        except ValueError as error:
            raise ConfigError(f"grammar constraints cannot use the tokenizer {type(tokenizer).__name__} with "
                              f"vocab_size {vocab_size}: {error}") from error
        vocab = _Vocab(tokenizer, converted, _usable_words(tokenizer, int(vocab_size)))
        _VOCABS[key] = vocab
        return vocab


def grammar_tokenizer(tokenizer, vocab_size: int, eos: Iterable[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a fast Hugging Face ``tokenizer`` for a model of ``vocab_size`` logits, whose grammars end
    with any of ``eos`` (default: the tokenizer's EOS). Converting is slow, so it is done once per (tokenizer object,
    vocab_size, eos) and kept; call it when a model is loaded to pay it there."""
    return _vocab(tokenizer, vocab_size, eos).converted


def _refused(grammar: str) -> str:
    """llguidance's error for ``grammar`` ("" when it compiles)."""
    return llguidance.LLMatcher.validate_grammar(grammar).strip()


def _json_grammar(schema: dict, where: str, lenient: bool) -> str:
    """The llguidance grammar of JSON matching ``schema``; ConfigError naming ``where`` if llguidance refuses it.
    lenient: keywords llguidance does not implement are ignored instead of refused."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={**JSON_OPTIONS, "lenient": lenient})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {error}") from error
    error = _refused(grammar)
    if error:
        raise ConfigError(f"{where}: {error}")
    return grammar


def _lark_string(text: str) -> str:
    """``text`` as a lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class GrammarSpec:
    """What an answer must look like; validated when built. `constraint` starts one answer's grammar state."""

    grammar: str  # llguidance grammar text, set (and validated) by each variant

    def grammar_for(self, tokenizer: llguidance.LLTokenizer) -> str:
        """The grammar as ``tokenizer`` needs it."""
        return self.grammar

    def constraint(self, tokenizer, vocab_size: int, eos: Iterable[int] | None = None) -> Constraint:
        """A fresh grammar state for one answer by a model of ``vocab_size`` logits using ``tokenizer`` (a fast
        Hugging Face tokenizer), ending with any of ``eos`` (default: the tokenizer's EOS)."""
        vocab = _vocab(tokenizer, vocab_size, eos)
        return Constraint(vocab.converted, self.grammar_for(vocab.converted), vocab.usable)


@dataclass(frozen=True)
class JsonObject(GrammarSpec):
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""

    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grammar", _json_grammar(ANY_OBJECT, "response_format", lenient=False))


@dataclass(frozen=True)
class JsonSchema(GrammarSpec):
    """JSON matching ``schema`` (OpenAI's ``response_format: {"type": "json_schema", ...}``). strict: keywords
    llguidance does not implement are refused; otherwise they are ignored."""

    schema: dict
    name: str = "response"
    strict: bool = False
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"response_format.json_schema.name: must be a non-empty string, not {self.name!r}")
        if not isinstance(self.schema, dict):
            raise ConfigError("response_format.json_schema.schema: must be a JSON object, not "
                              f"{type(self.schema).__name__}")
        check_schema_bounds(self.schema, "response_format.json_schema.schema")
        grammar = _json_grammar(self.schema, "response_format.json_schema.schema", lenient=not self.strict)
        object.__setattr__(self, "grammar", grammar)


@dataclass(frozen=True)
class ToolCalls(GrammarSpec):
    """Forced function calls, Hermes/Qwen2.5 style: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``.

    tools: (name, parameters JSON schema or None: any object) per function; name: the one function to call (OpenAI's
    ``tool_choice: {"type": "function", ...}``), None: any of them (``tool_choice: "required"``); parallel: one or more
    calls separated by ``"\\n"``, else exactly one. Parameter schemas are read leniently (unknown keywords ignored).
    """

    tools: tuple[tuple[str, dict | None], ...]
    name: str | None = None
    parallel: bool = True
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            tools = tuple((name, parameters) for name, parameters in self.tools)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"tools: must be (name, parameters) pairs: {error}") from error
        object.__setattr__(self, "tools", tools)
        if not tools:
            raise ConfigError("tools: a tool call is required but no tools are given")
        for i, (name, parameters) in enumerate(tools):
            if not isinstance(name, str) or not name:
                raise ConfigError(f"tools[{i}].function.name: must be a non-empty string, not {name!r}")
            if parameters is not None and not isinstance(parameters, dict):
                raise ConfigError(f"tools[{i}].function.parameters: must be a JSON object, not "
                                  f"{type(parameters).__name__}")
            if parameters is not None:
                check_schema_bounds(parameters, f"tools[{i}].function.parameters")
        names = [name for name, _ in tools]
        if self.name is not None and self.name not in names:
            raise ConfigError(f"tool_choice.function.name: {self.name!r} is not among the tools ({', '.join(names)})")
        for i, (_, parameters) in enumerate(tools):  # each schema on its own, to name the one refused
            _json_grammar(ANY_OBJECT if parameters is None else parameters, f"tools[{i}].function.parameters",
                          lenient=True)
        grammar = llguidance.LLMatcher.grammar_from_lark(self._lark(tuple(_lark_string(t) for t in _TOOL_TAGS)))
        error = _refused(grammar)
        if error:
            raise ConfigError(f"tools: {error}")
        object.__setattr__(self, "grammar", grammar)

    def _lark(self, tags: tuple[str, ...]) -> str:
        """The lark grammar of the calls, with the opening and closing tags written as the lark expressions ``tags``;
        each function's call is its name as literal text, then its arguments as %json."""
        rules = []
        for i, (name, parameters) in enumerate(self.tools):
            if self.name is not None and name != self.name:
                continue
            arguments = {**(ANY_OBJECT if parameters is None else parameters),
                         "x-guidance": {**JSON_OPTIONS, "lenient": True}}
            head = _lark_string('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
            rules.append((f"fn_{i}", f"{head} %json{json.dumps(arguments)} \"}}\""))
        calls = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        body = " | ".join(rule for rule, _ in rules)
        return "\n".join([calls, f'call: {tags[0]} "\\n" ({body}) "\\n" {tags[1]}',
                          *(f"{rule}: {text}" for rule, text in rules)])

    def grammar_for(self, tokenizer: llguidance.LLTokenizer) -> str:
        """The grammar with each tag that ``tokenizer`` has as one special token (Qwen2.5's <tool_call> and
        </tool_call>) written as that token: llguidance does not spell a special token's text with it."""
        tags = []
        for tag in _TOOL_TAGS:
            ids = tokenizer.tokenize_str(tag)
            special = len(ids) == 1 and tokenizer.is_special_token(ids[0])
            tags.append(tag if special else _lark_string(tag))
        if all(tag.startswith('"') for tag in tags):
            return self.grammar
        return llguidance.LLMatcher.grammar_from_lark(self._lark(tuple(tags)))


class Constraint:
    """One answer's grammar state: which tokens may come next (`allowed`, `mask`), advancing by the chosen token
    (`accept`), and whether the grammar is complete (`done`: the answer ends there) or may end (`stop_allowed`).
    usable: the bitmask of ids ever allowed (32 per int32 word, lowest bit first; default: all).

    A grammar no answer can begin is refused when the state is made (ConfigError), before any model work: one that
    allows no usable first token, or whose first allowed token already exceeds llguidance's limits (a required
    property that recurses without end, a pattern repeating a character a million times)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, usable: torch.Tensor | None = None) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"the grammar does not compile for this tokenizer: {self._first_line()}")
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self._bits = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self._usable = usable if usable is not None else torch.full_like(self._bits, -1)
        self._next: torch.Tensor | None = None  # `allowed` computed ahead (by the check below), until asked for
        self._next = self._first_allowed()

    def _first_line(self, matcher=None) -> str:
        error = (matcher or self._matcher).get_error().strip()
        return error.splitlines()[0] if error else ""

    def _first_allowed(self) -> torch.Tensor:
        """The tokens allowed first, once a copy of the state has taken the first of them; ConfigError if there is
        none, or if the grammar breaks on it."""
        fix = ("simplify the schema: e.g. a required property that recurses without end, or a pattern with a huge "
               "repetition count, cannot be followed")
        try:
            allowed = self.allowed()
        except KVHandoffError as error:
            raise ConfigError(f"the grammar cannot begin an answer ({error}); {fix}") from None
        first = allowed.nonzero()
        if not len(first):
            raise ConfigError(f"the grammar allows no token of this model's vocabulary to begin the answer; {fix}")
        probe = self._matcher.deep_copy()
        if not probe.consume_token(int(first[0])) or probe.is_error():
            reason = self._first_line(probe) or "its first token is refused"
            raise ConfigError(f"the grammar cannot begin an answer: {reason}; {fix}")
        return allowed

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (an end-of-text token only where it may end)."""
        if self._next is not None:
            allowed, self._next = self._next, None
            return allowed
        if self._matcher.is_error():
            raise KVHandoffError(f"the grammar state is broken: {self._first_line()}")
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._bits &= self._usable
        return ((self._bits.unsqueeze(1) >> _SHIFTS) & 1).view(-1)[: self.vocab_size].bool()

    def mask(self, logprobs: torch.Tensor) -> torch.Tensor:
        """``logprobs`` [vocab_size] with every token the grammar refuses next set to -inf (a new tensor)."""
        return logprobs.masked_fill(~self.allowed().to(logprobs.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance by ``token``; KVHandoffError (naming it) if the grammar does not allow it here."""
        token = int(token)
        self._next = None
        if not 0 <= token < self.vocab_size:
            raise KVHandoffError(f"token {token} is not allowed by the grammar: past the vocabulary "
                                 f"({self.vocab_size})")
        if not (self._usable[token // 32] >> (token % 32)) & 1:
            raise KVHandoffError(f"token {token} is not allowed by the grammar: it is vocabulary padding")
        if not self._matcher.consume_token(token):
            text = self._tokenizer.dbg_tokens([token])
            raise KVHandoffError(f"token {token} {text} is not allowed by the grammar here: {self._first_line()}")

    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the answer ends now."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def stop_allowed(self) -> bool:
        """The text so far is a complete answer (it may end here, or go on)."""
        return self._matcher.is_accepting()
