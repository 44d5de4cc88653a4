"""Independent draft models: tokenizer / vocabulary mismatch is a clear error."""


import pytest

from dspark.drafters.draft_lm.drafter import load_draft_model
from dspark.errors import IncompatibleModelsError
from tests.tiny import save_hf_folder, save_word_tokenizer, tiny_config


def test_vocab_mismatch_without_tokenizer(tmp_path, tiny):
    folder = save_hf_folder(tmp_path / "draft", tiny_config(vocab_size=tiny.vocab_size + 8))
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        load_draft_model(str(folder), tiny)


def test_same_vocab_loads(tmp_path, tiny):
    folder = save_hf_folder(tmp_path / "draft", tiny_config())
    drafter = load_draft_model(str(folder), tiny, block_size=3)
    assert drafter.block_size == 3


@pytest.mark.slow
def test_tokenizer_mismatch_with_smollm2(tmp_path, smollm2):
    folder = save_hf_folder(tmp_path / "draft", tiny_config(vocab_size=smollm2.vocab_size))
    save_word_tokenizer(folder, 101)
    with pytest.raises(IncompatibleModelsError, match="tokenizer"):
        load_draft_model(str(folder), smollm2)
