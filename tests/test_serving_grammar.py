"""Grammar constraints: random tiny models decoding under them always write what the spec asks for."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import AddedToken

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.serving.decoding import choose_token
from kvhandoff.serving.grammar import Constraint, GrammarSpec, JsonObject, JsonSchema, ToolCalls, grammar_tokenizer

from conftest import chat_tokenizer, tiny_model

VOCAB = 300
MAX_TOKENS = 200
#: greedy, then seeded samples
DRAWS = [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", layers=2, vocab_size=VOCAB, seed=3)


def closing_bias(tok, strength: float = 3.0) -> torch.Tensor:
    """Log-prob bias toward the tokens that close strings, arrays and objects and the end of text, so a grammar
    without bounds ends soon."""
    bias = torch.zeros(VOCAB)
    bias[[*tok.encode('"}]'), tok.eos_token_id]] = strength
    return bias


@torch.no_grad()
def decode(spec: GrammarSpec, tok, model, temperature: float, seed: int, bias: torch.Tensor | None = None) -> str:
    """The text a random model writes under ``spec`` (greedy or seeded sampling, at most MAX_TOKENS), checking at every
    step that the choice is allowed, padding never is, and the answer ends where the grammar is complete."""
    constraint = spec.constraint(tok, VOCAB)
    generator = torch.Generator().manual_seed(seed)
    out = model(input_ids=torch.tensor([tok.encode("answer:")]), use_cache=True)
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        allowed = constraint.allowed()
        assert allowed.shape == (VOCAB,) and allowed.dtype == torch.bool
        assert not allowed[len(tok):].any(), "an id past the tokenizer's vocabulary is allowed"
        logprobs = out.logits[0, -1].float().log_softmax(-1)
        if bias is not None:
            logprobs = logprobs + bias
        token = choose_token(constraint.mask(logprobs), temperature, 1.0, generator)
        assert allowed[token]
        if token == tok.eos_token_id:
            assert constraint.stop_allowed()
            break
        constraint.accept(token)
        tokens.append(token)
        if constraint.done():
            assert constraint.stop_allowed()
            assert constraint.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]
            break
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    else:
        pytest.fail(f"no end within {MAX_TOKENS} tokens: {tok.decode(tokens)!r}")
    return tok.decode(tokens)


def tool_calls(text: str) -> list[dict]:
    """The calls of ``<tool_call>\\n{...}\\n</tool_call>`` blocks separated by "\\n" (AssertionError otherwise)."""
    lines = text.split("\n")
    assert len(lines) % 3 == 0, text
    calls = []
    for opening, body, closing in zip(lines[::3], lines[1::3], lines[2::3], strict=True):
        assert (opening, closing) == ("<tool_call>", "</tool_call>"), text
        call = json.loads(body)
        assert list(call) == ["name", "arguments"], body
        calls.append(call)
    return calls


# -- structured output ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("temperature", "seed"), [*DRAWS, (1.0, 4), (1.0, 5)])
def test_json_object_output_always_parses_to_an_object(tok, model, temperature, seed):
    text = decode(JsonObject(), tok, model, temperature, seed, bias=closing_bias(tok))
    assert isinstance(json.loads(text), dict), text


NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
                                "required": ["name", "admin"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False,
    },
    "enum": {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, None]}},
        "required": ["color", "size"], "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False,
    },
    "integers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "delta": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["age", "delta"], "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": NAME,
                       "kind": {"type": "string", "enum": ["a", "b"]}},
        "required": ["id", "kind"], "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(tok, model, name):
    spec = JsonSchema(SCHEMAS[name], name=name, strict=True)
    for temperature, seed in DRAWS:
        text = decode(spec, tok, model, temperature, seed)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_schema_bounds_integers_and_refuses_a_text_that_breaks_it(tok):
    constraint = JsonSchema(SCHEMAS["integers"]).constraint(tok, VOCAB)
    feed(constraint, tok, '{"age": 12')
    allowed = constraint.allowed()
    assert allowed[tok.encode("0")].all() and allowed[tok.encode(",")].all()  # 120, or 12
    assert not allowed[tok.encode("123456789")].any()  # at most 120
    with pytest.raises(KVHandoffError, match="not allowed by the grammar"):
        constraint.accept(tok.encode("x")[0])


# -- forced tool calls ---------------------------------------------------------------------------------------------

TOOLS = (
    ("get_weather", {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}},
                     "required": ["city", "unit"], "additionalProperties": False}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}),
    ("ping", None),
)
SCHEMA_OF = {name: schema for name, schema in TOOLS}


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_name_a_tool_and_match_its_schema(tok, model, parallel):
    spec = ToolCalls(TOOLS, name=None, parallel=parallel)
    names = set()
    for temperature, seed in [*DRAWS, (1.0, 4), (1.0, 5)]:
        calls = tool_calls(decode(spec, tok, model, temperature, seed, bias=closing_bias(tok)))
        assert len(calls) >= 1
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            assert call["name"] in SCHEMA_OF
            assert isinstance(call["arguments"], dict)
            if SCHEMA_OF[call["name"]] is not None:
                jsonschema.validate(call["arguments"], SCHEMA_OF[call["name"]])
            names.add(call["name"])
    assert len(names) >= 2, "sampling never chose between the tools"


@pytest.mark.parametrize("name", [name for name, _ in TOOLS])
def test_a_named_tool_is_always_the_one_called(tok, model, name):
    spec = ToolCalls(TOOLS, name=name, parallel=True)
    for temperature, seed in DRAWS:
        for call in tool_calls(decode(spec, tok, model, temperature, seed, bias=closing_bias(tok))):
            assert call["name"] == name


def feed(constraint: Constraint, tok, text: str) -> None:
    for token in tok.encode(text):
        constraint.accept(token)


CALL = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def test_parallel_calls_are_separated_by_a_newline_and_one_call_ends_a_single_call(tok):
    newline, eos = tok.encode("\n")[0], tok.eos_token_id
    several = ToolCalls(TOOLS, parallel=True).constraint(tok, VOCAB)
    feed(several, tok, CALL)
    assert several.stop_allowed() and not several.done()
    assert several.allowed().nonzero().flatten().tolist() == sorted([newline, eos])
    feed(several, tok, "\n" + CALL.replace('"ping", "arguments": {}', '"add", "arguments": {"a": 1, "b": 2}'))
    assert several.stop_allowed()

    single = ToolCalls(TOOLS, parallel=False).constraint(tok, VOCAB)
    feed(single, tok, CALL)
    assert single.done()
    with pytest.raises(KVHandoffError, match=f"token {newline} "):
        single.accept(newline)


def test_tool_calls_need_the_name_before_the_arguments_and_a_known_name(tok):
    with pytest.raises(KVHandoffError):
        feed(ToolCalls(TOOLS).constraint(tok, VOCAB), tok, '<tool_call>\n{"arguments": {}, "name": "ping"}')
    with pytest.raises(KVHandoffError):
        feed(ToolCalls(TOOLS).constraint(tok, VOCAB), tok, '<tool_call>\n{"name": "pong"')
    with pytest.raises(KVHandoffError):
        feed(ToolCalls(TOOLS, name="add").constraint(tok, VOCAB), tok, '<tool_call>\n{"name": "ping"')


def test_tool_parameters_with_references_and_odd_names(tok):
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Digit"}}, "required": ["x"],
              "additionalProperties": False, "$defs": {"Digit": {"type": "integer", "minimum": 0, "maximum": 9}},
              "description": 'braces } and quotes " in text'}
    constraint = ToolCalls((('say "hi"', schema),), parallel=False).constraint(tok, VOCAB)
    feed(constraint, tok, '<tool_call>\n{"name": "say \\"hi\\"", "arguments": {"x": 7}}\n</tool_call>')
    assert constraint.done()
    refusing = ToolCalls((("f", schema),)).constraint(tok, VOCAB)
    feed(refusing, tok, '<tool_call>\n{"name": "f", "arguments": {"x": 1')  # the referenced definition: one digit
    with pytest.raises(KVHandoffError, match="not allowed"):
        refusing.accept(tok.encode("2")[0])


def test_tool_call_tags_that_are_single_tokens_are_written_as_those_tokens():
    tok = chat_tokenizer()  # as Qwen2.5's: <tool_call> and </tool_call> are added (not special) tokens
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    opening, closing = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    ids = tok.encode(CALL)
    assert ids[0] == opening and ids[-1] == closing
    constraint = ToolCalls(TOOLS, parallel=False).constraint(tok, VOCAB)
    assert constraint.allowed().nonzero().flatten().tolist() == [opening]
    for token in ids:
        constraint.accept(token)
    assert constraint.done()


# -- validation at the edge, and the grammar state's contract ----------------------------------------------------

@pytest.mark.parametrize(("build", "message"), [
    (lambda: JsonSchema(["not", "a", "dict"]), r"response_format\.json_schema\.schema: must be a JSON object"),
    (lambda: JsonSchema({"type": "foo"}), r"response_format\.json_schema\.schema: .*foo"),
    (lambda: JsonSchema({"type": "string", "pattern": "(("}), r"response_format\.json_schema\.schema: .*regex"),
    (lambda: JsonSchema({"type": "string", "format": "weird"}, strict=True),
     r"response_format\.json_schema\.schema: .*weird"),
    (lambda: JsonSchema({"type": "object"}, name=""), r"response_format\.json_schema\.name"),
    (lambda: ToolCalls(()), "tools: .*no tools"),
    (lambda: ToolCalls(TOOLS, name="nope"), r"tool_choice\.function\.name: 'nope' is not among the tools"),
    (lambda: ToolCalls((("f", None), ("g", "object"))), r"tools\[1\]\.function\.parameters: must be a JSON object"),
    (lambda: ToolCalls((("f", None), ("g", {"type": "foo"}))), r"tools\[1\]\.function\.parameters: .*foo"),
    (lambda: ToolCalls((("", None),)), r"tools\[0\]\.function\.name"),
    (lambda: ToolCalls(("f",)), "tools: must be"),
])
def test_refusals_name_the_problem(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
           "$ref": "#/$defs/n"}


@pytest.mark.parametrize("spec", [lambda: JsonSchema(ENDLESS), lambda: JsonSchema({"type": "string",
                                                                                   "pattern": "^a{1000000}$"}),
                                  lambda: ToolCalls((("f", ENDLESS),))])
def test_a_grammar_no_answer_can_begin_is_refused_when_its_state_is_made(tok, spec):
    with pytest.raises(ConfigError, match="cannot begin an answer"):
        spec().constraint(tok, VOCAB)


def test_schemas_past_the_bounds_are_refused_before_they_are_compiled():
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ConfigError, match=r"response_format\.json_schema\.schema: .* 64 levels"):
        JsonSchema(schema)
    with pytest.raises(ConfigError, match=r"tools\[0\]\.function\.parameters: .* 64 levels"):
        ToolCalls((("f", schema),))


def test_lenient_schemas_ignore_what_strict_ones_refuse(tok):
    JsonSchema({"type": "string", "format": "weird"}, strict=False).constraint(tok, VOCAB)
    ToolCalls((("f", {"type": "object", "properties": {"s": {"type": "string", "format": "weird"}}}),))


def test_accepting_a_refused_token_raises_naming_it(tok):
    constraint = JsonObject().constraint(tok, VOCAB)
    assert constraint.allowed().nonzero().flatten().tolist() == tok.encode("{")
    x = tok.encode("x")[0]
    with pytest.raises(KVHandoffError, match=f"token {x} "):
        constraint.accept(x)
    for token in (VOCAB - 1, VOCAB, -1):
        with pytest.raises(KVHandoffError, match=f"token {token} "):
            JsonObject().constraint(tok, VOCAB).accept(token)


def test_the_tokenizers_end_tokens_end_a_grammar(tok):
    end, other = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    default = ToolCalls(TOOLS).constraint(tok, VOCAB)
    both = ToolCalls(TOOLS).constraint(tok, VOCAB, eos=(end, other))
    for constraint in (default, both):
        assert not constraint.stop_allowed() and not constraint.allowed()[[end, other]].any()
        feed(constraint, tok, CALL)
    assert default.allowed()[end] and not default.allowed()[other]
    assert both.allowed()[end] and both.allowed()[other]


def test_gguf_vocabulary_padding_is_never_allowed():
    from transformers import Qwen2Tokenizer

    base = chat_tokenizer()  # as a GGUF conversion pads it: "[PAD<id>]" entries up to the model's vocab_size
    vocab = {**base.get_vocab(), **{f"[PAD{i}]": i for i in range(len(base), VOCAB)}}
    padded = Qwen2Tokenizer(vocab=vocab, merges=[("h", "e")], eos_token="<|im_end|>", unk_token=None,
                            pad_token="<|endoftext|>")
    assert len(padded) == VOCAB
    constraint = JsonSchema({"type": "string", "maxLength": 30}).constraint(padded, VOCAB)
    constraint.accept(padded.encode('"')[0])
    allowed = constraint.allowed()
    assert allowed[padded.encode("a")].all() and not allowed[len(base):].any()
    with pytest.raises(KVHandoffError, match="padding"):
        constraint.accept(len(base))


def test_the_tokenizer_conversion_is_cached_per_tokenizer_and_vocab_size(tok):
    assert grammar_tokenizer(tok, VOCAB) is grammar_tokenizer(tok, VOCAB)
    assert grammar_tokenizer(tok, VOCAB) is not grammar_tokenizer(tok, VOCAB + 20)
    assert grammar_tokenizer(tok, VOCAB) is not grammar_tokenizer(chat_tokenizer(), VOCAB)
    assert grammar_tokenizer(tok, VOCAB + 20).vocab_size == VOCAB + 20


def test_threads_converting_one_tokenizer_share_one_conversion():
    fresh = chat_tokenizer()
    with ThreadPoolExecutor(4) as pool:
        converted = list(pool.map(lambda _: grammar_tokenizer(fresh, VOCAB), range(8)))
    assert all(c is converted[0] for c in converted)


def test_tokenizers_it_cannot_use_are_refused(tok):
    from conftest import ByteTokenizer

    with pytest.raises(ConfigError, match="ByteTokenizer"):
        JsonObject().constraint(ByteTokenizer(), VOCAB)
    with pytest.raises(ConfigError, match="vocab_size 100"):
        JsonObject().constraint(tok, 100)


QWEN = Path("/root/.cache/kvhandoff/models/qwen2.5-coder-0.5b")


@pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(), reason="the Qwen2.5 tokenizer is not here")
def test_the_qwen_tokenizer_writes_tool_calls_as_its_template_does():
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(QWEN)
    vocab_size = 151936
    text = (CALL + "\n" + CALL.replace('"ping", "arguments": {}', '"get_weather", "arguments": {"city": "Paris", '
                                                                    '"unit": "c"}'))
    constraint = ToolCalls(TOOLS).constraint(qwen, vocab_size)
    ids = qwen.encode(text)
    assert constraint.allowed().nonzero().flatten().tolist() == [ids[0]] == qwen.convert_tokens_to_ids(["<tool_call>"])
    for token in ids:
        constraint.accept(token)
    assert constraint.allowed()[qwen.convert_tokens_to_ids("<|im_end|>")]

    inside = JsonSchema({"type": "string", "maxLength": 30}).constraint(qwen, vocab_size)
    inside.accept(qwen.encode('"')[0])
    allowed = inside.allowed()
    padding = qwen.convert_tokens_to_ids("[PAD151665]")
    assert allowed.sum() > 100_000 and not allowed[padding:].any()
