"""Integration: the trainer overfits a handful of sequences and the trained checkpoint, loaded through the
registry like `dspark generate --drafter CHECKPOINT` does, drafts them with acceptance near block size + 1
while greedy output stays exactly the target's."""

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.registry import load_drafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.training.config import TrainConfig
from dspark.training.trainer import train
from tests.tiny import tiny_target

BLOCK = 4
PROMPTS = [[5, 9, 13, 22], [40, 41, 7, 3, 18], [77, 12, 60]]
MODELS = {
    "dspark": {"block_size": BLOCK, "num_anchors": 32, "markov_rank": 32, "target_layer_ids": [0, 2, 3]},
    "dspark-rnn": {"block_size": BLOCK, "num_anchors": 32, "markov_rank": 32, "markov_head_type": "rnn",
                   "target_layer_ids": [0, 2, 3]},
    "dflash": {"block_size": BLOCK, "num_anchors": 32, "target_layer_ids": [0, 2, 3]},
    "eagle3": {"block_size": BLOCK, "ttt_length": BLOCK, "target_layer_ids": [0, 2, 3]},
}


@pytest.fixture(scope="module")
def target_and_data():
    target = tiny_target(seed=11, eos_token_id=999)  # no stop token: every sequence runs to its length
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    outs = SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate(PROMPTS, sp)
    data = []
    for p, r in zip(PROMPTS, outs):
        ids = torch.tensor(p + r.output_ids)
        mask = torch.tensor([0] * (len(p) - 1) + [1] * (len(r.output_ids) + 1))
        data.append({"input_ids": ids, "loss_mask": mask})
    return target, data, [r.output_ids for r in outs]


@pytest.mark.parametrize("kind", list(MODELS))
def test_overfit_then_generate_with_checkpoint(tmp_path, target_and_data, kind):
    target, data, greedy = target_and_data
    drafter = "eagle3" if kind == "eagle3" else ("dflash" if kind == "dflash" else "dspark")
    cfg = TrainConfig(drafter=drafter, out=str(tmp_path / kind), max_steps=600, grad_accum=1, lr=1e-2,
                      warmup_ratio=0.0, log_every=50, checkpoint_every=1000, num_threads=1, model=MODELS[kind])
    ckpt = train(cfg, target=target, dataset=data)
    spec_drafter = load_drafter(str(ckpt), target)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    out = SpeculativeGenerator(target, spec_drafter).generate(PROMPTS, sp)
    assert [r.output_ids for r in out] == greedy  # lossless
    taus = [r.stats.acceptance_length for r in out]
    mean_tau = sum(taus) / len(taus)
    assert mean_tau >= 0.75 * (BLOCK + 1), (kind, taus)
