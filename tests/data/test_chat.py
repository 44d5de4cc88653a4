import pytest

from dspark.errors import DSparkError
from dspark.data.chat import render_prompt, render_text, tokenize_conversation
from tests.training import smollm2_tokenizer

# A Qwen3-style template: the last reply carries an empty think block that past replies lose, so
# rendering a prefix does not give a prefix of the full rendering for earlier turns.
QWEN3_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)

REPLY_1 = "Hello! I am happy to help you with whatever question you have today."
REPLY_2 = "Why did the chicken cross the road? To get to the other side, of course."
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": REPLY_1},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": REPLY_2},
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def masked_text(tok, sample):
    return tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


def test_loss_mask_covers_exactly_the_replies_and_end_of_turn(tok):
    sample = tokenize_conversation(tok, CONVERSATION, max_length=512)
    assert masked_text(tok, sample) == f"{REPLY_1}<|im_end|>\n{REPLY_2}<|im_end|>\n"
    # negative control: the unmasked tokens are the prompts and the template's markup only
    unmasked = tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if not m])
    assert REPLY_1 not in unmasked and "Hi there" in unmasked and "Tell me a joke." in unmasked
    # same ids as tokenising the whole rendering at once (ChatML boundaries are special tokens)
    whole = tok(render_text(tok, CONVERSATION, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    assert sample["input_ids"] == list(whole)


def test_first_segment_is_the_inference_prompt(tok):
    sample = tokenize_conversation(tok, CONVERSATION, max_length=512)
    prompt = render_prompt(tok, "Hi there")
    assert sample["input_ids"][: len(prompt)] == prompt
    assert sample["loss_mask"][: len(prompt)] == [0] * len(prompt)
    assert sample["loss_mask"][len(prompt)] == 1


def test_render_prompt_has_one_user_turn_and_generation_prompt(tok):
    text = tok.decode(render_prompt(tok, "What is 2+2?"))
    assert text.count("<|im_start|>user\n") == 1 and text.endswith("<|im_start|>assistant\n")
    assert tok.bos_token is None or not text.startswith(tok.bos_token + tok.bos_token)


def test_truncation_cuts_the_end(tok):
    full = tokenize_conversation(tok, CONVERSATION, max_length=512)
    cut = tokenize_conversation(tok, CONVERSATION, max_length=60, min_loss_tokens=1)
    assert len(cut["input_ids"]) == len(cut["loss_mask"]) == 60
    assert cut["input_ids"] == full["input_ids"][:60] and cut["loss_mask"] == full["loss_mask"][:60]


def test_samples_with_few_loss_tokens_are_dropped(tok):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert tokenize_conversation(tok, short, max_length=512) is None  # default minimum: 14
    kept = tokenize_conversation(tok, short, max_length=512, min_loss_tokens=1)
    assert masked_text(tok, kept) == "Hello.<|im_end|>\n"
    # truncation can push a sample under the minimum
    assert tokenize_conversation(tok, CONVERSATION, max_length=45) is None


def test_system_message_is_kept_out_of_the_mask(tok):
    conversation = [{"role": "system", "content": "Be brief."}] + CONVERSATION[:2]
    sample = tokenize_conversation(tok, conversation, max_length=512)
    assert masked_text(tok, sample) == f"{REPLY_1}<|im_end|>\n"


def test_template_that_rewrites_past_turns(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", QWEN3_LIKE)
    sample = tokenize_conversation(tok, CONVERSATION, max_length=512)
    assert masked_text(tok, sample) == f"{REPLY_1}<|im_end|>\n{REPLY_2}<|im_end|>\n"
    # enable_thinking=False reaches a template that reads it
    assert tok.decode(render_prompt(tok, "Hi")).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_missing_chat_template_is_a_clear_error(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DSparkError, match="chat template"):
        render_prompt(tok, "Hi")
