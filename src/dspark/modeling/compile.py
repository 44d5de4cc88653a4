"""``--compile``: torch.compile the dense parts of every decoder layer (docs/architecture.md §Making a step cheap).

Attention stays eager: it reads the KV pool in blocks whose number changes from
step to step, and is already a few batched operations per layer. What is compiled is what
surrounds it — RMSNorm, the q/k/v projections with RoPE before, and o_proj, both
residual branches and the MLP after — so inductor can fuse the element-wise work
around the matmuls. Shapes are marked dynamic (N = tokens in the step varies), so
one graph serves prefill, decode and verify steps of any size.
"""

from __future__ import annotations

import torch

from dspark.errors import DSparkError
from dspark.modeling.decoder import CausalLM


def compile_decoder(model: CausalLM, mode: str | None = None) -> CausalLM:
    """Compile ``model``'s layers in place; returns it. Compilation happens on the first calls."""
    if not hasattr(torch, "compile"):
        raise DSparkError("--compile needs torch.compile (PyTorch 2)")
    for layer in model.model.layers:
        layer.pre_attention = torch.compile(layer.pre_attention, dynamic=True, mode=mode)
        layer.post_attention = torch.compile(layer.post_attention, dynamic=True, mode=mode)
    model.model.norm.forward = torch.compile(model.model.norm.forward, dynamic=True, mode=mode)
    return model
