"""A roofline SPS table for hardware we do not have: a stated model on a stated accelerator.

A verify step over B batch tokens costs

    T(B) = overhead + max(T_memory, T_compute(B))
    T_memory     = weight bytes read per step / (bandwidth * bandwidth efficiency)
    T_compute(B) = FLOPs per token * ceil(B / tile) * tile / (peak FLOPs * compute efficiency)

so SPS(B) = 1 / T(B) is flat while the step is memory-bound (every step streams the weights once, whatever
B) and then falls in jagged steps, one per ``tile`` tokens (GEMM tile / wave quantisation), which is the
shape paper §5.2 describes for production hardware. Every number is a field of ``RooflineAssumptions`` and
is written next to the table (``describe``).

Left out on purpose: KV-cache reads, which grow with the number of requests and their context rather than
with batch tokens, so a one-dimensional SPS(B) table (the paper's, SGLang's, ours) cannot hold them; and the
drafter's own pass, which the simulator adds per step as ``step_overhead_s``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dspark.scheduler.sps import SPSTable


@dataclass(frozen=True)
class RooflineAssumptions:
    name: str
    weight_bytes: float  # bytes of weights streamed per step
    flops_per_token: float  # forward FLOPs per token (2 x parameters + attention at the stated context)
    peak_flops: float  # dense peak of the accelerator(s), FLOP/s
    bandwidth: float  # memory bandwidth, bytes/s
    compute_efficiency: float = 0.6  # achieved / peak FLOPs in the large GEMMs
    bandwidth_efficiency: float = 0.8  # achieved / peak bandwidth when streaming weights
    tile: int = 64  # tokens per GEMM tile: compute cost moves in steps of this many tokens
    overhead_s: float = 0.0005  # per-step launch and synchronisation
    max_batch_tokens: int = 4096
    source: str = ""

    def step_seconds(self, batch_tokens: int) -> float:
        memory = self.weight_bytes / (self.bandwidth * self.bandwidth_efficiency)
        padded = math.ceil(batch_tokens / self.tile) * self.tile
        compute = self.flops_per_token * padded / (self.peak_flops * self.compute_efficiency)
        return self.overhead_s + max(memory, compute)

    def table(self) -> SPSTable:
        """Samples at 1 and at the first token of every further tile: T(B) only changes there, so the
        floor lookup (docs/interop.md §SPS table) is exact at every B up to ``max_batch_tokens``."""
        grid = [1] + list(range(self.tile + 1, self.max_batch_tokens + 1, self.tile))
        return SPSTable(grid, [1.0 / self.step_seconds(b) for b in grid], self.max_batch_tokens)

    def ridge_tokens(self) -> int:
        """The largest B whose step is still memory-bound (the end of the flat region)."""
        return max((b for b in range(1, self.max_batch_tokens + 1)
                    if self.step_seconds(b) <= self.step_seconds(1) + 1e-12), default=1)

    def describe(self) -> dict:
        return {**asdict(self), "flat_until_batch_tokens": self.ridge_tokens(),
                "step_ms_at_1": 1e3 * self.step_seconds(1),
                "step_ms_at_max": 1e3 * self.step_seconds(self.max_batch_tokens)}


def dense_8b_h200() -> RooflineAssumptions:
    """A dense 8B decoder (Qwen3-8B: 8.19e9 parameters, 36 layers, hidden 4096) in bf16 on one H200."""
    params, layers, hidden, context = 8.19e9, 36, 4096, 2048
    return RooflineAssumptions(
        name="dense 8B (Qwen3-8B-class), bf16, one H200",
        weight_bytes=2.0 * params,  # bf16: 16.4 GB streamed per step
        flops_per_token=2.0 * params + 4.0 * layers * hidden * context,  # matmuls + attention at 2k context
        peak_flops=989e12,  # H200 dense bf16 (SXM)
        bandwidth=4.8e12,  # H200 HBM3e
        source="H200 SXM datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e; Qwen3-8B config: 8.19B parameters, "
        "36 layers, hidden 4096; attention FLOPs 4 * layers * hidden * context at a 2,048-token context; "
        "efficiencies, tile and overhead are assumptions",
    )
