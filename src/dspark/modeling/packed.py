"""Prepacked CPU matmuls for decoding: each weight reordered once into oneDNN's blocked layout.

``nn.Linear`` on the CPU hands oneDNN a plain row-major weight, which it reorders
into its blocked layout on every call: for a decode step of 1-8 rows that reorder
costs as much as the product. ``pack_linears`` reorders every weight of the
decoder layers and the LM head once, at load (``load_target(fuse=True)`` on the
CPU, the decoding layout), and ``PackedLinear`` multiplies against the packed copy.
On SmolLM2-135M (one thread, bf16) an 8-token verify block gets about 1.5x faster, so verifying a block costs
about what one token does; a DSpark/DFlash drafter loaded for decoding gets the same
(``pack_all_linears``, keeping its parameters): docs/reports/performance-packing.md (``scripts/packed_linears.py``).

The products are the same oneDNN kernels' (bf16: bitwise equal to ``nn.Linear`` for two rows
or more, which ``TargetModel.batch_invariance_holds`` checks on the loaded model). The
layers' plain weights are dropped (a packed model is for decoding only, like a fused one);
the LM head keeps a reference to its weight, which the drafters share with the target.
"""

from __future__ import annotations

import torch
from torch import nn


#: bfloat16 products of fewer rows run on this many (the first row repeated, the extra outputs dropped). A decode
#: step's products have 1-2 rows (a lone row runs as two, ``Decoder.batch_invariant``; ``fixed:1`` verifies two), and
#: oneDNN streams the weights of 1- and 2-row products more slowly than of 3-8: SmolLM2's whole pass of 2 rows 28.0 ms
#: unpadded against 23.6 padded to 4, of 1 row 24.8 against 23.3, one thread (``scripts/verify_rows_cost.py --padding
#: both``, docs/serving.md §Engine). Every row keeps its bits: products of 2 to 32 rows give a row the same
#: bits (docs/reports/matmul-regimes.md), and the script checks the logits
MIN_ROWS = 4


class PackedLinear(nn.Module):
    """``y = x W^T + b`` against a weight reordered once for oneDNN (CPU, float32 or bfloat16)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, batch_hint: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)  # (out, in) blocked
        if keep_weight:  # the parameters stay (state_dict names, dtype/device reads, slices of the weight)
            self.weight, self.bias = linear.weight, linear.bias
        else:
            self.weight = None
            self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if 0 < n < MIN_ROWS and rows.dtype == torch.bfloat16:  # the first row repeated up to MIN_ROWS, then dropped
            rows = torch.cat([rows, rows[:1].expand(MIN_ROWS - n, -1)])
        out = _product(rows, self.packed, self.bias)[:n]
        return out.reshape(*x.shape[:-1], self.out_features)


def _product(
    rows: torch.Tensor,  # (M, in)
    packed: torch.Tensor,  # (out, in) blocked
    bias: torch.Tensor | None,
) -> torch.Tensor:  # (M, out)
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build can prepack ``weight`` (a CPU float32/bfloat16 tensor, oneDNN available)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the ops are torch-internal: a build without them decodes unpacked
        probe = torch.ops.mkldnn._reorder_linear_weight(weight[:8, :8].detach().contiguous(), 2)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=weight.dtype), probe, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def _pack(module: nn.Module, keep_weight) -> int:
    """Replace every ``nn.Linear`` below ``module`` by a ``PackedLinear``; ``keep_weight(name)`` says which keep
    their parameters. Returns how many were packed: 0, changing nothing, where this build or device cannot."""
    linears = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not linears or not can_pack(linears[0][2].weight):
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, keep_weight=keep_weight(name)))
    return len(linears)


def pack_linears(model: nn.Module) -> bool:
    """Pack the decoder layers' projections and the LM head of a ``CausalLM`` (decoding only: the layers' plain
    weights are dropped, the LM head's kept). Returns False, changing nothing, where this build or device
    cannot pack."""
    if isinstance(model.lm_head, PackedLinear):
        return True
    return _pack(model, keep_weight=lambda name: name == "lm_head") > 0


def pack_all_linears(module: nn.Module) -> int:
    """Every ``nn.Linear`` below ``module`` as a ``PackedLinear`` that keeps its weight (a drafter reads its
    weights' dtype and device and slices some of them), for decoding only. Returns how many were packed: 0,
    changing nothing, where this build or device cannot pack."""
    return _pack(module, keep_weight=lambda name: True)
