"""Model-state memory per rank for the bundled Qwen3-8B DSpark recipe under DDP and FSDP (docs/training.md §FSDP).

    .venv/bin/python scripts/fsdp_memory.py

Counts parameters of the drafter built on the meta device from Qwen3-8B's published config (no weights
needed) and prints GiB per rank of what sits in memory between steps: the frozen target, the drafter's
parameters, gradients, fp32 master weights and AdamW moments. Activations, the feature batch and the
all-gathered working copy (see below) come on top.
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.drafters.checkpoint import draft_spec_from
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkModel
from dspark.modeling.decoder import CausalLM
from dspark.modeling.spec import spec_from_config
from dspark.presets import read_preset

QWEN3_8B = {  # config.json of Qwen/Qwen3-8B
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
}
GIB = 2**30


def main() -> None:
    spec = spec_from_config(QWEN3_8B)
    fields = {f.name for f in dataclasses.fields(DSparkConfig)}
    cfg = DSparkConfig(**{k: v for k, v in read_preset("qwen3-8b-dspark")["model"].items() if k in fields})
    with torch.device("meta"):
        target = CausalLM(spec)
        drafter = DSparkModel(cfg, draft_spec_from(spec, cfg.num_draft_layers), dict(QWEN3_8B), spec.num_layers)
    n_target = sum(p.numel() for p in target.parameters())
    n_layers = sum(p.numel() for p in target.model.layers.parameters())
    n_draft = sum(p.numel() for p in drafter.parameters())
    n_train = sum(p.numel() for p in drafter.trainable_parameters())
    print(f"target {n_target / 1e9:.2f} B params ({n_layers / 1e9:.2f} B in decoder layers); drafter "
          f"{n_draft / 1e9:.2f} B ({n_train / 1e9:.2f} B trainable, {(n_draft - n_train) / 1e9:.2f} B frozen "
          "embedding + LM head)\n")
    print("| ranks | DDP: target bf16 + drafter bf16 + 14 B/trainable | FSDP, feature cache | FSDP, online features |")
    print("|---:|---:|---:|---:|")
    for w in (2, 4, 8):
        ddp = 2 * n_target + 2 * n_draft + 14 * n_train  # bf16 params, bf16 grads, fp32 master + 2 moments
        # FSDP: fp32 sharded params (master) + fp32 sharded grads + 2 moments; frozen params fp32 sharded
        fsdp_state = (16 * n_train + 4 * (n_draft - n_train)) / w
        cache = 2 * (n_target - n_layers) + fsdp_state  # decoder layers on the meta device
        online = 2 * (n_target - n_layers) + 2 * n_layers / w + fsdp_state
        print(f"| {w} | {ddp / GIB:.1f} GiB | {cache / GIB:.1f} GiB | {online / GIB:.1f} GiB |")
    print(f"\nFSDP, during a step: + the gathered bf16 drafter ({2 * n_draft / GIB:.1f} GiB, freed after forward "
          f"and after backward); online: + one gathered target layer ({2 * n_layers / spec.num_layers / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()
