"""Prompt token ids from a request: a text or id prompt, or chat messages through the chat template.

The server calls these in a worker thread (tokenising a huge prompt must not block the event loop).
``chat_template_kwargs`` reach the template as variables, as in vLLM: ``{"enable_thinking": false}``
renders a Qwen3 prompt without thinking, as the drafter's training data was made
(``dspark.data.chat``).
"""

from __future__ import annotations

import inspect
from typing import Any

from jinja2 import TemplateError

from dspark.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_text

ROLES = ("system", "developer", "user", "assistant")


def encode_prompt(tokenizer, req: CompletionRequest) -> list[int]:
    check_text(req.prompt, "prompt")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"send one prompt per request (got {len(prompt)})", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens))
    return list(prompt)


def _template_kwargs(tokenizer, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables. A key that names an argument of apply_chat_template
    itself (tokenize, tools, ...) is refused: it would change the call, not the template."""
    kwargs = dict(kwargs or {})
    check_text(kwargs, "chat_template_kwargs")
    own = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    for key in kwargs:
        if key in own:
            raise APIError(400, f"chat_template_kwargs.{key} is an argument of the template call, not a template "
                           "variable; use the request field of that name where there is one",
                           param=f"chat_template_kwargs.{key}")
    return kwargs


def encode_messages(tokenizer, req: ChatCompletionRequest) -> list[int]:
    if not req.messages:
        raise APIError(400, "messages is empty; send at least one message", param="messages")
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
    return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
