"""Chat-template tokenisation with an assistant-only loss mask, for any Hugging Face template.

The assistant spans are found by rendering prefixes rather than by matching template strings:
for assistant turn i, `render(messages[:i], add_generation_prompt=True)` ends where the reply
starts and `render(messages[:i+1])` ends after its end-of-turn markup (e.g. `<|im_end|>\n` for
ChatML). Where a template rewrites earlier turns once later ones exist (Qwen3 drops the think block
of past replies), the reply is located in the full rendering instead.

The text is tokenised segment by segment (prompt, reply, prompt, ...), each with
`add_special_tokens=False`: the first segment then tokenises exactly as `render_prompt` does at
inference, and each reply as the target would have generated it after that prompt.

Loss-mask values: 0 = not supervised; 1 = supervised, the reply is the target's own (regenerated);
`TARGET_LABEL` (2) = supervised, the reply is existing text labelled by the target in one prefill
(records with `"label": "teacher_forced"`, `dspark data label`), so its CE label is the target's
argmax (docs/training.md §Teacher-forced labelling). Whatever only asks "supervised?" reads `!= 0`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.drafters.losses import TARGET_LABEL
from dspark.errors import DSparkError
from dspark.target.model import chat_template_kwargs as _template_kwargs

TEACHER_FORCED = "teacher_forced"  # a record's "label": its replies are existing text, labelled by the target
MIN_LOSS_TOKENS = 14  # DeepSpec drops samples with fewer supervised tokens (docs/interop.md §Training data files)


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template applied to `messages`, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise DSparkError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "use an instruction-tuned target whose tokenizer_config.json carries one")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **_template_kwargs(tokenizer))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def render_prompt(tokenizer, user_message: str) -> list[int]:
    """Token ids of a first-turn prompt as evaluation feeds it (docs/interop.md §Evaluation protocol).

    One user message, no system prompt added by us (a template's own default stays),
    `add_generation_prompt=True`, `add_special_tokens=False`.
    """
    return _encode(tokenizer, render_text(tokenizer, [{"role": "user", "content": user_message}], True))


@dataclass(frozen=True)
class _Span:
    start: int  # character offsets into the full rendering
    end: int


def assistant_spans(tokenizer, conversations: list[dict]) -> tuple[str, list[_Span]]:
    """The full rendering and the character span of every assistant reply plus its end-of-turn."""
    full = render_text(tokenizer, conversations, add_generation_prompt=False)
    spans: list[_Span] = []
    cursor = 0
    for i, message in enumerate(conversations):
        if message.get("role") != "assistant":
            continue
        before = render_text(tokenizer, conversations[:i], add_generation_prompt=True)
        through = render_text(tokenizer, conversations[:i + 1], add_generation_prompt=False)
        if through.startswith(before) and full.startswith(through) and len(before) >= cursor:
            span = _Span(len(before), len(through))
        else:  # the template rewrote this turn in context: find the reply itself
            content = message["content"]
            at = through.rfind(content)
            end_markup = through[at + len(content):] if content and at >= 0 else ""
            start = full.find(content, cursor) if content else -1
            if start < 0 or not full.startswith(end_markup, start + len(content)):
                raise DSparkError(
                    f"cannot locate assistant turn {i} in the rendered chat template; "
                    "check that the conversation alternates user/assistant turns")
            span = _Span(start, start + len(content) + len(end_markup))
        spans.append(span)
        cursor = span.end
    return full, spans


def reply_mask_value(record: dict) -> int:
    """The loss-mask value of a record's reply tokens: TARGET_LABEL for teacher-forced records, else 1."""
    return TARGET_LABEL if record.get("label") == TEACHER_FORCED else 1


def tokenize_conversation(tokenizer, conversations: list[dict], max_length: int, min_loss_tokens: int = MIN_LOSS_TOKENS,
                          reply_mask: int = 1) -> dict[str, list[int]] | None:
    """`{"input_ids": [...], "loss_mask": [...]}` for one conversation, or None when dropped.

    loss_mask is `reply_mask` (1, or TARGET_LABEL for labelled text) exactly on assistant reply tokens
    and each reply's end-of-turn tokens, 0 elsewhere. The
    sequence is truncated to `max_length` tokens (the end is cut); samples with fewer than
    `min_loss_tokens` supervised tokens after truncation are dropped (None).
    """
    if max_length <= 0:
        raise DSparkError("max_length must be positive")
    full, spans = assistant_spans(tokenizer, conversations)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    cursor = 0
    for span in spans:
        for text, label in ((full[cursor:span.start], 0), (full[span.start:span.end], reply_mask)):
            ids = _encode(tokenizer, text)
            input_ids += ids
            loss_mask += [label] * len(ids)
        cursor = span.end
    tail = _encode(tokenizer, full[cursor:])
    input_ids += tail
    loss_mask += [0] * len(tail)
    input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if sum(m != 0 for m in loss_mask) < min_loss_tokens:
        return None
    return {"input_ids": input_ids, "loss_mask": loss_mask}
