"""Drafter checkpoints: round trips, DeepSpec layout (docs/interop.md §Drafter checkpoints), compatibility errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.base import NoDrafter
from dspark.drafters.checkpoint import spec_to_hf_config
from dspark.drafters.dspark.drafter import DSparkDrafter, load_dspark_drafter, save_dspark_checkpoint
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.eagle3.drafter import Eagle3Drafter, load_eagle3_drafter
from dspark.drafters.eagle3.model import Eagle3Model
from dspark.drafters.options import DraftingOptions
from dspark.drafters.registry import checkpoint_kind, load_drafter
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.generation.generator import SpeculativeGenerator
from dspark.modeling.spec import spec_from_config
from dspark.sampling.processing import SamplingParams
from tests.tiny import tiny_config, tiny_target

from .tiny_drafters import LAYER_IDS, random_tokens, request_after, tiny_dflash, tiny_dspark, tiny_eagle3

BUILDERS = {
    "dspark": lambda t: tiny_dspark(t),
    "dspark-rnn": lambda t: tiny_dspark(t, markov_head_type="rnn"),
    "dflash": lambda t: tiny_dflash(t),
}


def _same_proposals(target, a, b) -> None:
    prompt = random_tokens(7, seed=21)
    ra = request_after(target, prompt, LAYER_IDS, SamplingParams(temperature=1.0, seed=5))
    rb = request_after(target, prompt, LAYER_IDS, SamplingParams(temperature=1.0, seed=5))
    pa, pb = a.propose([ra], [3]), b.propose([rb], [3])
    assert torch.equal(pa.tokens, pb.tokens)
    assert torch.allclose(pa.draft_probs, pb.draft_probs, atol=1e-6)


@pytest.mark.parametrize("variant", list(BUILDERS))
def test_dspark_round_trip(tiny, tmp_path, variant):
    model = BUILDERS[variant](tiny)
    save_dspark_checkpoint(model, tmp_path)
    assert checkpoint_kind(tmp_path) == "dspark"
    loaded = DSparkModel.from_checkpoint(tmp_path, tiny)
    assert loaded.config == model.config
    own, back = model.state_dict(), loaded.state_dict()
    assert own.keys() == back.keys()
    assert all(torch.equal(own[k], back[k]) for k in own)
    assert {id(p) for p in loaded.trainable_parameters()}.isdisjoint(
        {id(loaded.lm_head.weight), id(loaded.embed_tokens.weight)})
    drafter = load_drafter(str(tmp_path), tiny)
    assert isinstance(drafter, DSparkDrafter) and drafter.block_size == model.config.block_size
    _same_proposals(tiny, DSparkDrafter(model), drafter)


def test_dspark_config_json_has_deepspec_keys(tiny, tmp_path):
    tiny_dspark(tiny, draft_layer="target").save_checkpoint(tmp_path / "dspark")
    cfg = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaDSparkModel"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["num_target_layers"] == 4
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"] == ["full_attention"]
    assert cfg["target_layer_ids"] == LAYER_IDS and cfg["block_size"] == 4 and cfg["mask_token_id"] == 95
    assert cfg["markov_rank"] == 8 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert "num_anchors" in cfg and "auto_map" not in cfg
    tiny_dflash(tiny).save_checkpoint(tmp_path / "dflash")
    cfg = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert cfg["markov_rank"] == 0 and cfg["enable_confidence_head"] is False
    assert "markov_head_type" not in cfg and "confidence_head_with_markov" not in cfg
    names = set(load_file(str(tmp_path / "dflash" / "model.safetensors")))
    assert not any(n.startswith(("markov_head", "confidence_head", "model.")) for n in names)


def test_bf16_checkpoint_loads_in_float32(tiny, tmp_path):
    model = tiny_dspark(tiny)
    model.save_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert load_file(str(tmp_path / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    loaded = load_dspark_drafter(tmp_path, tiny).model
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.allclose(loaded.fc.weight, model.fc.weight, rtol=1e-2, atol=1e-2)


def test_eagle3_round_trip(tiny, tmp_path):
    model = tiny_eagle3(tiny)
    model.save_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaEagle3Model"] and checkpoint_kind(tmp_path) == "eagle3"
    assert (cfg["ttt_length"], cfg["step_loss_decay"], cfg["draft_num_hidden_layers"]) == (3, 0.8, 1)
    assert cfg["target_layer_ids"] == LAYER_IDS and cfg["num_target_layers"] == 4
    loaded = Eagle3Model.from_checkpoint(tmp_path, tiny)
    assert loaded.config == model.config
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    drafter = load_drafter(str(tmp_path), tiny, DraftingOptions(block_size=2))
    assert isinstance(drafter, Eagle3Drafter) and drafter.block_size == 2
    _same_proposals(tiny, Eagle3Drafter(model), load_eagle3_drafter(tmp_path, tiny))


# --------------------------------------------------------------------------- DeepSpec layout


def _deepspec_qwen3_checkpoint(folder, target_cfg: dict, rank: int = 8, n_layers: int = 2, target=None) -> None:
    """A Qwen3 DSpark checkpoint written by hand with exactly DeepSpec's key names and shapes (bf16);
    embed_tokens / lm_head are ``target``'s (a DeepSpec checkpoint carries its target's)."""
    H, V, I = target_cfg["hidden_size"], target_cfg["vocab_size"], target_cfg["intermediate_size"]
    nh, nkv, hd = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"], target_cfg["head_dim"]
    layer_ids = [0, 1, 3]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(torch.bfloat16)

    state = {
        "embed_tokens.weight": rnd(V, H), "lm_head.weight": rnd(V, H),
        **({} if target is None else {"embed_tokens.weight": target.model.model.embed_tokens.weight.to(torch.bfloat16),
                                      "lm_head.weight": target.model.lm_head.weight.to(torch.bfloat16)}),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16), "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "fc.weight": rnd(H, len(layer_ids) * H),
        "markov_head.markov_w1.weight": rnd(V, rank), "markov_head.markov_w2.weight": rnd(V, rank),
        "confidence_head.proj.weight": rnd(1, H + rank), "confidence_head.proj.bias": rnd(1),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rnd(nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
            p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
            p + "mlp.down_proj.weight": rnd(H, I),
            p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        })
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    config = {
        **target_cfg, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": n_layers,
        "num_target_layers": target_cfg["num_hidden_layers"], "block_size": 4, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * n_layers, "mask_token_id": V - 1, "target_layer_ids": layer_ids,
        "num_anchors": 512, "enable_confidence_head": True, "markov_rank": rank,
        "confidence_head_with_markov": True, "markov_head_type": "vanilla", "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_deepspec_qwen3_layout_loads_and_drafts_losslessly(tmp_path):
    target_cfg = tiny_config(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    target = tiny_target(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    _deepspec_qwen3_checkpoint(tmp_path, target_cfg, target=target)
    drafter = load_drafter(str(tmp_path), target)
    assert isinstance(drafter, DSparkDrafter)
    m = drafter.model
    assert m.config.markov_rank == 8 and m.config.num_draft_layers == 2 and m.config.num_anchors == 512
    assert m.layers[0].self_attn.q_norm is not None  # Qwen3: q_norm/k_norm come with the architecture
    assert m.fc.weight.dtype == torch.float32
    state = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(m.markov_head.markov_w2.weight, state["markov_head.markov_w2.weight"].float())
    # nothing missing, nothing extra (the decoding drafter's projections are fused ones: it refuses to be saved)
    assert set(DSparkModel.from_checkpoint(tmp_path, target).state_dict()) == set(state)
    with pytest.raises(RuntimeError, match="decoding"):
        m.save_checkpoint(tmp_path / "again")
    assert drafter.target_layer_ids == [0, 1, 3]

    prompt = random_tokens(6, seed=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate([prompt], sp)[0]
    spec = SpeculativeGenerator(target, drafter).generate([prompt], sp)[0]
    assert spec.output_ids == plain.output_ids
    # without a target (e.g. for inspection) it loads too
    assert DSparkModel.from_checkpoint(tmp_path).config.block_size == 4


# --------------------------------------------------------------------------- errors


def test_incompatible_targets_are_refused(tiny, tmp_path):
    tiny_dspark(tiny).save_checkpoint(tmp_path)
    wider = tiny_target(hidden_size=48, head_dim=12)
    with pytest.raises(IncompatibleModelsError, match="hidden size 32"):
        load_dspark_drafter(tmp_path, wider)
    with pytest.raises(IncompatibleModelsError, match="vocabulary 96"):
        load_dspark_drafter(tmp_path, tiny_target(vocab_size=100))
    shallow = tiny_target(num_hidden_layers=3)
    with pytest.raises(IncompatibleModelsError, match=r"target_layer_ids \[3\]"):
        load_dspark_drafter(tmp_path, shallow)
    with pytest.raises(ValueError, match="trained with block_size 4"):
        load_dspark_drafter(tmp_path, tiny, block_size=5)
    tiny_eagle3(tiny).save_checkpoint(tmp_path / "e")
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        load_eagle3_drafter(tmp_path / "e", tiny_target(vocab_size=100))


def test_broken_checkpoints_raise_model_load_errors(tiny, tmp_path):
    tiny_dspark(tiny).save_checkpoint(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["markov_head.markov_w1.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="markov_head.markov_w1.weight"):
        load_dspark_drafter(tmp_path, tiny)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        load_dspark_drafter(tmp_path, tiny)


@pytest.mark.parametrize("overrides", [
    {},
    {"model_type": "qwen3"},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"model_type": "mistral", "sliding_window": 16},
    {"model_type": "gemma"},
    {"model_type": "gemma2", "attn_logit_softcapping": None, "final_logit_softcapping": 30.0},
    {"model_type": "gemma3_text", "sliding_window": 8, "rope_local_base_freq": 1000.0, "sliding_window_pattern": 2},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "mlp_bias": True, "attention_bias": True},
])
def test_spec_to_hf_config_round_trips(overrides):
    """Targets without a folder (tests) get a synthesized config.json that reproduces their architecture."""
    spec = spec_from_config(tiny_config(**overrides))
    assert spec_from_config(spec_to_hf_config(spec)) == spec
