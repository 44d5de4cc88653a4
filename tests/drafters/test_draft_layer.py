"""``draft_layer="qwen3"``: Qwen3-shaped draft layers (q/k RMSNorm, SiLU, plain RMSNorm) whatever the target family,
saved as a Qwen3 config that reads back to the same layers; the target distribution keeps the target's soft-cap."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.dspark.model import DSparkModel
from dspark.modeling.spec import spec_from_config
from tests.tiny import tiny_target

from .tiny_drafters import LAYER_IDS, random_tokens, sample_for, tiny_dflash, tiny_dspark

TARGETS = {
    "llama": {},
    "gemma2": {"model_type": "gemma2", "final_logit_softcapping": 30.0},
    "gemma3": {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2},
}


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("make", [tiny_dspark, tiny_dflash])
def test_qwen3_layers_for_any_target_save_and_load_as_qwen3(arch, make, tmp_path):
    tiny = tiny_target(**TARGETS[arch])
    model = make(tiny, draft_layer="qwen3")
    s = model.spec
    assert (s.model_type, s.qk_norm, s.hidden_act, s.norm_offset, s.sandwich_norms) == ("qwen3", True, "silu", 0.0, False)
    assert s.embed_scale == 1.0 and s.final_softcap is None and s.attn_softcap is None and s.attn_scale is None
    assert model.layers[0].self_attn.q_norm is not None and not hasattr(model.layers[0], "pre_feedforward_layernorm")
    model.save_checkpoint(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["draft_layer"] == "qwen3" and cfg["target_model_type"] == tiny.spec.model_type
    assert spec_from_config(cfg) == s  # the engines read the same layers from config.json
    back = DSparkModel.from_checkpoint(tmp_path / "d", tiny)
    assert back.config.draft_layer == "qwen3"
    sample = sample_for(tiny, random_tokens(14, seed=2), LAYER_IDS)
    anchors = torch.tensor([2, 6])
    assert torch.allclose(model.block_logits(sample, anchors), back.block_logits(sample, anchors), atol=1e-5)


def test_qwen3_layers_are_the_default_and_target_family_layers_stay_available():
    tiny = tiny_target(**TARGETS["gemma2"])
    assert tiny_dspark(tiny).config.draft_layer == "qwen3" and tiny_dspark(tiny).spec.model_type == "qwen3"
    model = tiny_dspark(tiny, draft_layer="target")
    assert model.spec.model_type == "gemma2" and model.spec.sandwich_norms


@pytest.mark.parametrize("draft_layer", ["target", "qwen3"])
def test_target_distribution_keeps_the_targets_soft_cap(draft_layer, tmp_path):
    """p_t is the target's: its LM head and its final soft-cap (Gemma2: 30) whatever the draft's layers are;
    the negative control, the draft's own logits of a Qwen3-layer drafter, are not soft-capped."""
    tiny = tiny_target(**TARGETS["gemma2"])
    model = tiny_dspark(tiny, draft_layer=draft_layer)
    model.save_checkpoint(tmp_path / "d")
    back = DSparkModel.from_checkpoint(tmp_path / "d", tiny)
    hidden = torch.randn(5, tiny.spec.hidden_size) * 20
    want = tiny.model.logits(hidden)
    for m in (model, back):
        assert torch.allclose(m.target_logits(hidden), want, atol=1e-4)
    if draft_layer == "qwen3":
        assert not torch.allclose(model.base_logits(hidden), want, atol=1e-2)


def test_unknown_draft_layer_is_refused():
    with pytest.raises(ValueError, match="draft_layer"):
        tiny_dspark(tiny_target(), draft_layer="llama")
