"""A request's inputs: its prompt as token ids (the family's chat template, and the length checks that refuse an
over-long prompt before it is tokenized whole), checked against the model that serves it with its grammar."""

from __future__ import annotations

import logging

from kvhandoff.errors import ConfigError
from kvhandoff.serving.chat import chat_template_of, render, render_text
from kvhandoff.serving.decoding import Sampler
from kvhandoff.serving.grammar import ToolCalls
from kvhandoff.serving.requests import GenerationRequest, RequestError
from kvhandoff.serving.worker import HostedModel

logger = logging.getLogger(__name__)

def family_template(models) -> str:
    """The chat template every hosted model renders conversations with: the first model's. A conversation must be
    the same tokens whichever model serves a turn, or a switch can reuse only up to where two renderings part."""
    names = list(models)
    template = chat_template_of(models[names[0]][1])
    differing = [name for name in names[1:] if chat_template_of(models[name][1]) != template]
    if differing:
        logger.warning("the chat templates of %s differ from %s's; every model renders conversations with %s's, so "
                       "that a conversation's tokens are the same whichever model serves", ", ".join(differing),
                       names[0], names[0])
    return template


#: characters tokenized at a time when a long text is checked against the context window
LENGTH_CHUNK_CHARS = 1 << 16
#: tokens a cut between two chunks may add to their count (the tokenizer cannot merge across it)
CHUNK_CUT_TOKENS = 8


#: the special tokens that open a chat message in the templates of the families served (ChatML, Llama 3, Gemma)
MESSAGE_OPENERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")


def message_anchor_ids(tokenizer) -> tuple[int, ...]:
    """The ids of ``tokenizer``'s special tokens that open a chat message (`MESSAGE_OPENERS`; none: an empty
    tuple): where a run of a conversation reused at another offset may start."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return tuple(added[token] for token in MESSAGE_OPENERS if token in added)


def surely_longer(tokenizer, text: str, limit: int, add_special_tokens: bool = True) -> bool:
    """Whether ``text`` is surely more than ``limit`` tokens: counted a chunk at a time (`LENGTH_CHUNK_CHARS`,
    each cut allowed `CHUNK_CUT_TOKENS`), stopping once past the limit, so an over-long text is refused without
    being tokenized whole. False, uncounted, for a text of at most `LENGTH_CHUNK_CHARS` or 8 × ``limit``
    characters: its one exact count decides, at about the cost of this one."""
    if len(text) <= max(LENGTH_CHUNK_CHARS, 8 * limit):
        return False
    count = 0
    for cuts, start in enumerate(range(0, len(text), LENGTH_CHUNK_CHARS)):
        piece = text[start:start + LENGTH_CHUNK_CHARS]
        count += len(tokenizer(piece, add_special_tokens=add_special_tokens and not start)["input_ids"])
        if count - cuts * CHUNK_CUT_TOKENS > limit:
            return True
    return False


def too_long(field: str, window: int, tokens: int | None = None) -> RequestError:
    """The refusal of a prompt of ``tokens`` (None: more than the window) past a context of ``window`` tokens."""
    count = f"{tokens} tokens" if tokens is not None else f"more than {window} tokens"
    return RequestError("too_long", f"This model's maximum context length is {window} tokens, prompt and answer "
                        f"together. However, your {field} resulted in {count}. Please reduce the length of the "
                        f"{field}.", param=field, code="context_length_exceeded")


def prompt_ids(tokenizer, vocab_size: int, messages=None, prompt=None, tools=None, template=None,
               limit: int | None = None) -> list[int]:
    """The token ids a request's model reads: chat ``messages`` (OpenAI-shaped dicts) rendered by the tokenizer's
    chat template with ``tools``, or a completion ``prompt`` (text, or token ids checked against ``vocab_size``).
    A text surely past ``limit`` tokens is refused (`too_long`) before it is tokenized whole."""
    if messages is not None:
        try:
            text = render_text(tokenizer, messages, tools, template=template)
        except ConfigError as exc:
            raise RequestError("invalid_request", str(exc), param="messages") from exc
        if limit is not None and surely_longer(tokenizer, text, limit, add_special_tokens=False):
            raise too_long("messages", limit)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, str):
        if limit is not None and surely_longer(tokenizer, prompt, limit):
            raise too_long("prompt", limit)
        return list(tokenizer(prompt)["input_ids"])
    ids = list(prompt or ())
    if any(not 0 <= token < vocab_size for token in ids):
        raise RequestError("invalid_request", f"token ids must be in 0..{vocab_size - 1}", param="prompt")
    return ids


def request_inputs(hosted: HostedModel, request: GenerationRequest, chat_template: str, max_context: int):
    """(prompt ids, one grammar constraint per answer or None) of ``request`` for ``hosted``; what does not fit
    the model (a token id past its vocabulary, a conversation its template refuses, sampling or a grammar it cannot
    serve) is a `RequestError`."""
    prompt = prompt_ids(hosted.tokenizer, hosted.vocab_size, request.messages, request.prompt, request.tools,
                        chat_template, max_context)
    try:
        Sampler(request.sampling, hosted.stop_ids, hosted.vocab_size, prompt)
    except ConfigError as exc:
        raise RequestError("invalid_request", str(exc), param=exc.field) from exc
    if request.grammar is None:
        return prompt, None
    try:
        constraints = [request.grammar.constraint(hosted.tokenizer, hosted.vocab_size, eos=hosted.stop_ids)
                       for _ in range(request.choices)]
    except ConfigError as exc:
        param = "tool_choice" if isinstance(request.grammar, ToolCalls) else "response_format"
        raise RequestError("invalid_request", str(exc), param=param) from exc
    return prompt, constraints


def tokenize(hosted: HostedModel, chat_template: str, prompt: str | None = None, messages=None, tools=None,
             add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
    """The token ids ``hosted`` reads for a ``prompt`` or chat ``messages`` (as a request's would be built)."""
    if messages is None:
        return list(hosted.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    try:
        return render(hosted.tokenizer, messages, tools, add_generation_prompt, chat_template)
    except ConfigError as exc:
        raise RequestError("invalid_request", str(exc), param="messages") from exc


def detokenize(hosted: HostedModel, tokens: list[int]) -> str:
    """The text of ``tokens`` under ``hosted``'s tokenizer; ids past its vocabulary are a `RequestError`."""
    if any(not 0 <= token < hosted.vocab_size for token in tokens):
        raise RequestError("invalid_request", f"token ids must be in 0..{hosted.vocab_size - 1}", param="tokens")
    return hosted.tokenizer.decode(tokens)
