"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for drafter training: ``parallel: fsdp`` under torchrun.

What is sharded, per rank of W (docs/training.md §Beyond one process: sharded features and FSDP):

- The drafter (``DrafterWithLoss``) is one FSDP unit: at rest every parameter (the frozen embedding
  and LM head too), every gradient, the fp32 master weights (the sharded parameters themselves; the
  compute dtype comes from a ``MixedPrecisionPolicy``) and both AdamW moments hold 1/W of the
  tensor. The parameters are all-gathered for the forward and again for the backward, and freed
  after each. One unit because the drafters call their layers' methods (``project_kv``,
  ``ttt_attention``) outside the layers' ``forward``, where per-layer FSDP hooks would not fire.
- The frozen target: with a feature cache its decoder layers are never run, so they are moved to
  the ``meta`` device (no memory; the embedding and LM head the drafter copied stay). Computing
  features online, each decoder layer is its own FSDP unit, gathered for ``pre_attention`` and
  again for ``post_attention`` (registered as FSDP forward methods) and freed after each.

Checkpoints keep the one-process layout: the full state is gathered (``DTensor.full_tensor``, one
tensor at a time) and written as ``model.safetensors`` + ``config.json`` and unsharded
``training_state.rank{r}.pt`` files, so a DDP or one-process run resumes an FSDP checkpoint and
the other way round; on resume every rank keeps its own slice of the saved full tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

PARALLEL_MODES = ("ddp", "fsdp")


def _mesh(device: torch.device, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def shard_drafter(net: nn.Module, device: torch.device, world_size: int, dtype: torch.dtype) -> nn.Module:
    """``net`` (fp32 parameters) sharded in place as one FSDP unit that computes in ``dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(net, mesh=_mesh(device, world_size), mp_policy=policy)
    return net


def shard_target(target, device: torch.device, world_size: int, online: bool) -> None:
    """Bound the frozen target's memory per rank (see the module docstring)."""
    layers = target.model.model.layers
    if not online:
        layers.to("meta")  # never run: the features come from the cache
        return
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = _mesh(device, world_size)
    for layer in layers:  # Decoder.forward calls these two methods, never layer.forward
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        register_fsdp_forward_method(layer, "pre_attention")
        register_fsdp_forward_method(layer, "post_attention")


def full_tensor(t: Any) -> Any:
    """The whole tensor of a DTensor (a collective: every rank calls it in the same order), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` sharded as ``like`` is (this rank keeps its slice; no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def full_master_weights(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [full_tensor(p.detach()).cpu() for p in params]


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded moment gathered: the one-process format."""
    sd = optimizer.state_dict()
    state = {i: {k: full_tensor(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in sorted(sd["state"].items())}
    return {"state": state, "param_groups": sd["param_groups"]}


def shard_optimizer_state(sd: dict, params: list[nn.Parameter]) -> dict:
    """A one-process optimizer state dict with each moment cut to this rank's slice of its parameter."""
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: local_slice(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in s.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


@contextmanager
def full_state_dict(model: nn.Module) -> Iterator[None]:
    """Inside, ``model.state_dict()`` returns full CPU tensors (gathered here, on every rank), so the
    drafter's own ``save_checkpoint`` writes the one-process files."""
    full = {k: full_tensor(v).cpu() for k, v in model.state_dict().items()}
    model.state_dict = lambda *args, **kwargs: full  # an instance attribute shadows the method
    try:
        yield
    finally:
        del model.state_dict


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s total norm over DTensor gradients is a DTensor; the number."""
    return float(full_tensor(norm))
