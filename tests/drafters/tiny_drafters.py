"""Tiny random drafters (DSpark, DFlash, Eagle3) on the tiny target, for fast tests."""

from __future__ import annotations

import torch

from dspark.drafters.base import RequestState
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Model
from dspark.drafters.registry import model_kind_entry
from dspark.drafters.sample import TrainSample, make_train_sample
from dspark.sampling.processing import SamplingParams
from dspark.target.model import TargetModel

LAYER_IDS = [0, 2, 3]  # three of the tiny target's four layers


def sharpen(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """Scale the trainable matrices from the N(0, 0.02) init to N(0, std), like the tiny target's
    weights, so the Markov bias and the confidence head matter in an untrained drafter."""
    with torch.no_grad():
        for p in model.trainable_parameters():
            if p.dim() == 2:
                p.mul_(std / 0.02)
    return model


def tiny_dspark(target: TargetModel, seed: int = 0, **overrides) -> DSparkModel:
    kw = dict(block_size=4, markov_rank=8, num_anchors=6, target_layer_ids=LAYER_IDS)
    kw.update(overrides)
    model = DSparkModel.from_target(target, DSparkConfig(**kw), torch.Generator().manual_seed(seed))
    return sharpen(model)


def tiny_dflash(target: TargetModel, seed: int = 0, **overrides) -> DSparkModel:
    kw = dict(block_size=4, num_anchors=6, target_layer_ids=LAYER_IDS)
    kw.update(overrides)
    model = DSparkModel.from_target(target, DSparkConfig.dflash(**kw), torch.Generator().manual_seed(seed))
    return sharpen(model)


def tiny_eagle3(target: TargetModel, seed: int = 0, **overrides) -> Eagle3Model:
    kw = dict(ttt_length=3, block_size=3, target_layer_ids=LAYER_IDS)
    kw.update(overrides)
    model = Eagle3Model.from_target(target, Eagle3Config(**kw), torch.Generator().manual_seed(seed))
    return sharpen(model)


def random_tokens(n: int, seed: int, vocab: int = 96, low: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


def sample_for(target: TargetModel, tokens: list[int], layer_ids: list[int],
               loss_mask: list[int] | None = None) -> TrainSample:
    return make_train_sample(target, tokens, loss_mask, layer_ids)


def request_after(target: TargetModel, tokens: list[int], layer_ids: list[int],
                  sampling: SamplingParams | None = None, seed: int = 0) -> RequestState:
    """A request whose committed tokens are ``tokens`` (last = anchor), context features as the loop keeps them."""
    sampling = sampling or SamplingParams(temperature=1.0, max_new_tokens=32, seed=seed)
    req = RequestState("r", len(tokens) - 1, list(tokens), sampling, sampling.make_generator())
    ids = torch.tensor(tokens[:-1], dtype=torch.long)
    out = target.forward(ids, [len(ids)], None, capture_layers=layer_ids, logits_for="none")
    req.context_features = out.features
    return req


def greedy_continuation(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    from dspark.drafters.base import NoDrafter
    from dspark.generation.generator import SpeculativeGenerator

    sp = SamplingParams(temperature=0.0, max_new_tokens=n)
    return SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate([prompt], sp)[0].output_ids


def training_loss(model: torch.nn.Module, sample: TrainSample, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """The model's outputs on ``sample`` scored by its kind's loss module (what the trainer computes)."""
    loss = model_kind_entry(model).loss_class(model.config)
    return loss(model, model(sample, generator), sample)


def overfit(model: torch.nn.Module, sample: TrainSample, steps: int = 100, lr: float = 3e-3) -> dict[str, float]:
    """Train on one sequence (fixed seeds) so that drafts get accepted; returns the last metrics."""
    opt = torch.optim.Adam(model.trainable_parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss, metrics = training_loss(model, sample, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return metrics


def overfit_on_greedy(target: TargetModel, model: torch.nn.Module, prompt: list[int], n: int = 40) -> list[int]:
    """Overfit ``model`` to the target's greedy continuation of ``prompt``; returns that continuation."""
    cont = greedy_continuation(target, prompt, n)
    mask = [0] * (len(prompt) - 1) + [1] * (len(cont) + 1)
    overfit(model, sample_for(target, prompt + cont, model.target_layer_ids, mask))
    return cont
