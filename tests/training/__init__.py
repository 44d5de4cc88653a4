from functools import lru_cache


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The default target's tokenizer (the HF folder is converted on first use, e.g. in CI)."""
    from transformers import AutoTokenizer

    from dspark.target.convert import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
