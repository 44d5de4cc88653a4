"""The distilled draft LM (drafter kind "draft-lm"): HF folder round trip, distillation loss, lossless decoding.

Models: tiny random Llama targets (tests/tiny.py). The HF-folder tests give the
target a 96-token word-level tokenizer so the tokenizer copy and check run too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dspark.drafters.draft_lm.model import CONFIG_KEY, DraftLMConfig, DraftLMModel, saved_block_size
from dspark.drafters.draft_lm.drafter import DraftModelDrafter, load_draft_model
from dspark.drafters.options import DraftingOptions
from dspark.drafters.registry import load_drafter
from dspark.errors import IncompatibleModelsError
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.target.model import load_target
from dspark.training.config import TrainConfig, TrainConfigError, load_config
from dspark.data.features import build_feature_cache
from dspark.drafters.sample import make_train_sample
from dspark.training.trainer import train
from tests.drafters.tiny_drafters import training_loss
from tests.tiny import save_hf_folder, tiny_config, tiny_target, save_word_tokenizer


def hf_target(folder, **overrides):
    """A tiny HF Llama folder with a word-level tokenizer of the model's 96 tokens, loaded as our target."""
    cfg = tiny_config(**overrides)
    save_hf_folder(folder, cfg)
    save_word_tokenizer(folder, cfg["vocab_size"])
    return load_target(str(folder))


def random_data(n: int, length: int = 24, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(length, dtype=torch.long)
        mask[:4] = 0  # an unsupervised "prompt"
        out.append({"input_ids": torch.randint(2, 96, (length,), generator=g), "loss_mask": mask})
    return out


def draft_logits(model: DraftLMModel, ids: torch.Tensor) -> torch.Tensor:  # (L,) -> (L, V)
    with torch.no_grad():
        hidden, _ = model.lm.model(ids, [ids.numel()], None)
        return model.lm.logits(hidden)


# ---------------------------------------------------------------- the model and its HF folder

def test_full_depth_copy_is_the_target_and_kl_is_zero(tiny):
    """Copying every layer reproduces the target exactly; the teacher then matches the draft row for row."""
    model = DraftLMModel.from_target(tiny, DraftLMConfig(layer_ids=[0, 1, 2, 3]))
    ids = torch.randint(2, 96, (20,), generator=torch.Generator().manual_seed(1))
    expected = tiny.forward(ids, [20], None).logits
    assert torch.allclose(draft_logits(model, ids), expected, atol=1e-5)
    sample = make_train_sample(tiny, ids, None, [1])
    loss, metrics = training_loss(model, sample)
    assert abs(metrics["kl"]) < 1e-5 and metrics["acc"] > 1 - 1e-4
    pruned = DraftLMModel.from_target(tiny, DraftLMConfig(num_layers=2))
    _, m2 = training_loss(pruned, sample)
    assert m2["kl"] > 0.1  # negative control: two of four layers is a different distribution


def test_pruned_copy_takes_the_chosen_layers_and_freezes_embeddings(tiny):
    model = DraftLMModel.from_target(tiny, DraftLMConfig(layer_ids=[0, 3]))
    src = tiny.model.state_dict()
    own = model.lm.state_dict()
    assert torch.equal(own["model.layers.1.self_attn.q_proj.weight"], src["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(own["model.layers.0.mlp.up_proj.weight"], src["model.layers.0.mlp.up_proj.weight"])
    trainable = {id(p) for p in model.trainable_parameters()}
    assert id(model.lm.lm_head.weight) not in trainable and id(model.lm.model.embed_tokens.weight) not in trainable
    assert id(model.lm.model.norm.weight) in trainable
    unfrozen = DraftLMModel.from_target(tiny, DraftLMConfig(num_layers=1, freeze_embeddings=False))
    assert id(unfrozen.lm.lm_head.weight) in {id(p) for p in unfrozen.trainable_parameters()}
    assert unfrozen.teacher_head is not None and "teacher_head" not in unfrozen.state_dict()
    with pytest.raises(ValueError, match="target has 4"):
        DraftLMModel.from_target(tiny, DraftLMConfig(num_layers=5))


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_is_an_hf_folder_that_ours_and_transformers_load(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    target = hf_target(tmp_path / "target", tie_word_embeddings=tied)
    model = DraftLMModel.from_target(target, DraftLMConfig(num_layers=2, block_size=3))
    folder = tmp_path / "draft"
    model.save_checkpoint(folder)

    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["num_hidden_layers"]) == ("llama", ["LlamaForCausalLM"], 2)
    assert cfg[CONFIG_KEY]["source_layer_ids"] == [0, 1] and cfg[CONFIG_KEY]["num_target_layers"] == 4
    assert saved_block_size(folder) == 3
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= keys
    assert not [k for k in keys if k.startswith("model.layers.2.")]
    assert (folder / "tokenizer.json").read_bytes() == (tmp_path / "target" / "tokenizer.json").read_bytes()

    ids = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(2))
    expected = draft_logits(model, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()  # (b) HF assisted generation's loader
    with torch.no_grad():
        assert torch.allclose(hf(ids[None]).logits[0], expected, atol=1e-4)
    drafter = load_draft_model(str(folder), target, block_size=3)  # (a) our independent-draft loader
    assert torch.allclose(drafter.model.logits(drafter.model.model(ids, [12], None)[0]), expected, atol=1e-5)
    assert isinstance(load_drafter(str(folder), target), DraftModelDrafter)
    again = DraftLMModel.from_checkpoint(folder, target)
    assert again.source_layer_ids == [0, 1] and again.config.block_size == 3
    assert all(torch.equal(a, b) for a, b in zip(again.lm.state_dict().values(), model.lm.state_dict().values()))


def test_draft_for_another_vocabulary_is_refused(tmp_path, tiny):
    folder = tmp_path / "draft"
    DraftLMModel.from_target(tiny, DraftLMConfig(num_layers=1)).save_checkpoint(folder)
    other = tiny_target(vocab_size=128)
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        DraftLMModel.from_checkpoint(folder, other)
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        load_draft_model(str(folder), other)


# ---------------------------------------------------------------- training

def test_trainer_overfits_and_writes_hf_checkpoints(tmp_path, tiny):
    out = tmp_path / "run"
    cfg = TrainConfig(drafter="draft-lm", out=str(out), max_steps=30, log_every=1, checkpoint_every=30,
                      grad_accum=2, lr=3e-3, warmup_ratio=0.0, num_threads=1, model={"num_layers": 1})
    last = train(cfg, target=tiny, dataset=random_data(2))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, final = lines[0], lines[-1]
    assert final["kl"] < 0.5 * first["kl"], (first["kl"], final["kl"])
    assert final["acc"] > first["acc"]
    assert json.loads((last / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    drafter = load_drafter(str(last), tiny)  # the step folder is a drafter as it is
    assert isinstance(drafter, DraftModelDrafter)


def test_trainer_reads_any_feature_cache_of_the_target(tmp_path, tiny):
    data = random_data(2, length=16)
    cache = build_feature_cache(tiny, data, [1, 2], tmp_path / "cache", progress=False)
    cfg = TrainConfig(drafter="draft-lm", out=str(tmp_path / "run"), max_steps=2, log_every=1, grad_accum=1,
                      feature_source="cache", cache_dir=str(cache), num_threads=1, model={"num_layers": 1})
    assert (train(cfg, target=tiny) / "model.safetensors").is_file()


def test_config_preset_and_unknown_keys():
    cfg = load_config("smollm2-draft-lm")
    assert (cfg.drafter, cfg.model["num_layers"], cfg.max_length) == ("draft-lm", 4, 512)
    with pytest.raises(TrainConfigError, match="unknown model config key"):
        load_config("smollm2-draft-lm", ["model.target_layer_ids=[1]"])


# ---------------------------------------------------------------- decoding with it

@pytest.mark.parametrize("layer_ids", [[0, 1, 2, 3], [0]])
def test_greedy_speculative_output_equals_plain_greedy(tmp_path, tiny, layer_ids):
    folder = tmp_path / "draft"
    DraftLMModel.from_target(tiny, DraftLMConfig(layer_ids=layer_ids)).save_checkpoint(folder)
    prompts = [[5, 17, 33, 8, 60], [70, 3, 3, 41]]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = SpeculativeGenerator(tiny).generate(prompts, sampling)
    spec = SpeculativeGenerator(tiny, load_drafter(str(folder), tiny, DraftingOptions(block_size=4))).generate(prompts, sampling)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    if layer_ids == [0, 1, 2, 3]:  # positive control: the full copy is the target, every draft is accepted
        for r in spec:
            assert r.stats.sum_acceptance_length == len(r.output_ids) - 1
            assert r.stats.counts[4][4] >= 1
