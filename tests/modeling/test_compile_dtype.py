"""``--compile`` and ``--dtype``: the compiled decoder computes what the eager one does; bf16 loads end to end."""

from __future__ import annotations

import argparse

import pytest
import torch

from dspark.cli import main
from dspark.drafters.options import DraftingOptions
from dspark.drafters.registry import load_drafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.modeling.compile import compile_decoder
from dspark.sampling.processing import SamplingParams
from dspark.cli_options import load_target_from_args
from tests.tiny import save_hf_folder, save_word_tokenizer, tiny_config, tiny_target


def test_compiled_decoder_matches_eager_logits_and_greedy_output():
    eager, compiled = tiny_target(seed=3), tiny_target(seed=3)
    compile_decoder(compiled.model)
    ids = torch.randint(0, eager.vocab_size, (11,))
    outs = []
    for m in (eager, compiled):  # prefill 7 tokens, then a 4-token verify block against the cache
        cache = m.model.new_cache(32)
        h1, _ = m.model.model(ids[:7], [7], [cache])
        h2, _ = m.model.model(ids[7:], [4], [cache])
        outs.append(torch.cat([h1, h2]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompt = ids[:5].tolist()
    plain = SpeculativeGenerator(eager).generate([prompt], sp)[0].output_ids
    lookup = load_drafter("prompt-lookup", compiled, DraftingOptions(block_size=3))
    assert SpeculativeGenerator(compiled, lookup).generate([prompt], sp)[0].output_ids == plain


def test_bfloat16_target_and_draft_model_follow_the_dtype(tmp_path):
    folder = save_hf_folder(tmp_path / "t", tiny_config())
    save_word_tokenizer(folder, tiny_config()["vocab_size"])
    args = argparse.Namespace(target=str(folder), dtype="bfloat16", compile=False)
    target = load_target_from_args(args)
    assert target.model.lm_head.weight.dtype == torch.bfloat16
    drafter = load_drafter(str(folder), target, DraftingOptions(block_size=2))  # the folder itself as an independent draft model
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    out = SpeculativeGenerator(target, drafter).generate([[1, 2, 3]], sp)[0].output_ids
    assert out == SpeculativeGenerator(target).generate([[1, 2, 3]], sp)[0].output_ids


def test_generate_cli_accepts_dtype_and_rejects_unknown(tmp_path, capsys):
    folder = save_hf_folder(tmp_path / "t", tiny_config())
    save_word_tokenizer(folder, tiny_config()["vocab_size"])
    assert main(["generate", "--target", str(folder), "--dtype", "bfloat16", "--prompt", "w1 w2 w3",
                 "--max-new-tokens", "4", "--json"]) == 0
    assert '"new_tokens": 4' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(folder), "--dtype", "float16", "--prompt", "w1"])


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen3"}, {"model_type": "qwen2"},
                                       {"model_type": "gemma2", "final_logit_softcapping": 30.0}])
def test_fused_projections_compute_the_same_as_separate_ones(overrides):
    from dspark.modeling.layers import fuse_projections

    plain, fused = tiny_target(seed=4, **overrides), tiny_target(seed=4, **overrides)
    fuse_projections(fused.model.model.layers)
    layer = fused.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
    ids = torch.randint(0, plain.vocab_size, (9,))
    outs = [m.model.logits(m.model.model(ids, [5, 4])[0]) for m in (plain, fused)]  # two requests, no cache
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
