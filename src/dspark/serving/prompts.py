"""Prompt token ids from a request: a text or id prompt, or chat messages through the chat template.

The server calls these in a worker thread (tokenising a huge prompt must not block the event loop).
``chat_template_kwargs`` reach the template as variables, as in vLLM: ``{"enable_thinking": false}``
renders a Qwen3 prompt without thinking, as the drafter's training data was made
(``dspark.data.chat``).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from jinja2 import TemplateError

from dspark.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_text, prompt_value

ROLES = ("system", "developer", "user", "assistant")


_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The most characters one token covers: the longest vocabulary entry (byte-level and SentencePiece
    vocabularies write each character, or byte, of a token as one character)."""
    try:
        return _MAX_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    try:
        _MAX_TOKEN_CHARS[tokenizer] = longest
    except TypeError:  # not weak-referenceable
        pass
    return longest


def check_prompt_chars(tokenizer, chars: int, max_prompt_tokens: int | None, truncating: bool) -> None:
    """400 before tokenising a text that must have more than ``max_prompt_tokens`` tokens: a huge prompt
    costs a worker thread a second at most, not the 20 s an 8 MB prompt takes to tokenise. Sound: a
    text of ``chars`` characters has at least chars / max_token_chars tokens."""
    if max_prompt_tokens is None or truncating:
        return
    longest = max_token_chars(tokenizer)
    if chars > longest * max_prompt_tokens:
        raise APIError(400, f"the prompt has {chars} characters, so more than {max_prompt_tokens} tokens (no token "
                       f"of this model covers more than {longest} characters), and this server accepts at most "
                       f"{max_prompt_tokens}; shorten the prompt", param="prompt", code="prompt_too_long")


def encode_prompt(tokenizer, req: CompletionRequest, max_prompt_tokens: int | None = None) -> list[int]:
    """The prompt's token ids; ``max_prompt_tokens`` refuses, untokenised, a text sure to be longer."""
    prompt = prompt_value(req.prompt)
    check_text(prompt, "prompt")
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        check_prompt_chars(tokenizer, len(prompt), max_prompt_tokens, req.truncate_prompt_tokens is not None)
        return list(tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens))
    return list(prompt)


# Names the template render itself binds (transformers' render_jinja_template passes messages, tools,
# documents and add_generation_prompt; the Jinja environment defines raise_exception and strftime_now).
# A chat_template_kwargs key among them would collide with those arguments (a TypeError) or replace a
# helper the template calls; the tokenizer's special tokens (bos_token, ...) would change the prompt's
# control tokens. All are refused with a 400 naming the key.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "conversation", "conversations", "tools", "documents",
                                     "add_generation_prompt", "continue_final_message", "chat_template",
                                     "return_assistant_tokens_mask", "raise_exception", "strftime_now"})


def reserved_template_names(tokenizer) -> frozenset[str]:
    """Keys ``chat_template_kwargs`` may not carry: the arguments of apply_chat_template itself, the names
    its template render binds, and the tokenizer's special tokens."""
    own = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    special = set(getattr(tokenizer, "special_tokens_map", None) or {})
    return frozenset(own | special | RESERVED_TEMPLATE_NAMES)


def _template_kwargs(tokenizer, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables; a reserved name (``reserved_template_names``) is
    refused: it would change the call or the template's own arguments, not set a template variable."""
    kwargs = dict(kwargs or {})
    check_text(kwargs, "chat_template_kwargs")
    reserved = reserved_template_names(tokenizer)
    for key in kwargs:
        check_text(key, "chat_template_kwargs key")
        if key in reserved:
            raise APIError(400, f"chat_template_kwargs.{key} is reserved: the chat template call sets '{key}' "
                           "itself; remove it (use the request field of that name where there is one)",
                           param=f"chat_template_kwargs.{key}", code="reserved_template_kwarg")
        if not key.isidentifier():
            raise APIError(400, f"chat_template_kwargs.{key!r} is not a template variable name",
                           param="chat_template_kwargs")
    return kwargs


def encode_messages(tokenizer, req: ChatCompletionRequest, max_prompt_tokens: int | None = None) -> list[int]:
    """The chat template's token ids; ``max_prompt_tokens`` refuses, unrendered, messages whose text alone
    is sure to be longer."""
    if not req.messages:
        raise APIError(400, "messages is empty; send at least one message", param="messages")
    if max_prompt_tokens is not None and len(req.messages) > max_prompt_tokens:  # each adds a role marker at least
        raise APIError(400, f"{len(req.messages)} messages make a prompt of more than {max_prompt_tokens} tokens, "
                       "the most this server accepts", param="messages", code="prompt_too_long")
    check_text(req.messages, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be system, user or assistant, got {role!r}",
                           param=f"messages[{i}].role")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    check_prompt_chars(tokenizer, sum(len(m["content"]) for m in messages), max_prompt_tokens,
                       req.truncate_prompt_tokens is not None)
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "the messages are empty", param="messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true; send "
                       "add_generation_prompt=false to continue the last message", param="continue_final_message")
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs an assistant message last", param="continue_final_message")
    kwargs = _template_kwargs(tokenizer, req.chat_template_kwargs)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, **kwargs)
    except (TemplateError, ValueError) as err:  # the template's raise_exception() on these messages
        raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None
    except (TypeError, AttributeError, KeyError, IndexError) as err:  # a template variable of the wrong type
        where = "chat_template_kwargs" if kwargs else "messages"
        raise APIError(400, f"the chat template cannot render this request ({type(err).__name__}: {err}); "
                       f"check {where}", param=where) from None
    return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
