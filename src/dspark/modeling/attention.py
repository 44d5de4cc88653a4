"""Attention for a whole flattened, variable-length batch: one call per layer.

The decoder concatenates the requests' tokens (N = Σ n_r); their KV caches are slots of one
``KVPool`` tensor. ``BatchLayout`` says, once per forward, where every token sits (request, row,
absolute position, slot) and which key blocks of the pool each request reads; each layer then writes
its new keys/values into the pool with one indexed store and attends with one set of batched tensor
operations, as vLLM's attention metadata does for its kernels.

Keys are read in blocks of ``BLOCK`` positions (a request of S keys reads ceil(S / BLOCK) blocks, so a
batch costs Σ S_r, not R x max S_r): every (request, block) pair gets its scores, its running maximum,
its sum of exponentials and its weighted sum of values in one batched matmul, and the blocks of a
request are then combined in order (the split softmax of flash-decoding):

    m_b = max_j s_bj,  l_b = Σ_j exp(s_bj - m_b),  o_b = Σ_j exp(s_bj - m_b) v_j
    out = Σ_b exp(m_b - M) o_b / Σ_b exp(m_b - M) l_b,   M = max_b m_b

Load independence (CPU): a query row's output is computed the same way whatever else is in the batch.
Its blocks are the same blocks at the same absolute positions, every block has the same shape, masked
positions weigh exactly 0, and the combination adds its blocks in their order; query rows are rows of
the matmuls, which oneDNN computes alike whatever their number (docs/architecture.md §Making a step cheap). Prefill
pieces go the same way, so a prompt fed in pieces gives the rows it gives whole.
``tests/modeling/test_attention.py`` checks this bitwise in bfloat16 and float32.

In bfloat16 on the CPU (no soft-capping, no gradient) the same guarantee comes from torch's fused attention
(``F.scaled_dot_product_attention``, its flash kernel: no key-block gather, no score tensor in memory), 2.2-8.5x
faster per call here (scripts/fused_attention.py), over views of the pool: one call per run of consecutive slots,
split where padding to the run's longest request costs more than another call (``key_groups``). Each KV head's
query heads are folded into query rows, (R, Hkv, g*T, D),
so every matmul of the kernel has at least ``MIN_ROWS`` rows (fewer are repeated up to it): oneDNN's bf16 matmuls
give a row the same bits whatever the number of rows from there on, which the kernel's online softmax then keeps
(below 4 rows torch takes other kernels, whose rows differ on some CPUs: 1-3 rows on an AVX512-BF16 AMD EPYC, 1 on
Intel AMX parts). However many masked keys pad a row changes no bit on those Intel parts, but does on the AMD one
(``padding_invariant``: there each request is attended alone). float32 matmuls do not keep a row's bits across
shapes (MKL picks kernels by shape), so float32 keeps the block-split path; the tests check both paths bitwise.
On a GPU the padded block goes to SDPA (fused kernels; no such guarantee).

With the decoder's C kernels on (``Decoder.attention_kernel``) the decode and verify rows of all requests go to
``cpu_kernels.attention`` in one call per layer instead, each token reading positions ``lo .. hi-1`` of its slot
(``BatchLayout.kernel_ranges``). The prompt pieces the caller names (``plan_kernel_attention``'s ``prompt_from``)
keep torch's fused path above on CPUs with AMX tiles, where it is faster on long query blocks, and join the kernel's
call elsewhere (``cpu_kernels.prompts_to_kernel``).

Shapes: R = requests, N = tokens, T = most query rows of one request, B = key blocks read (all
requests), L = BLOCK, S = padded key length (GPU path), Hq / Hkv = query / KV heads, g = Hq / Hkv,
D = head dim, P = slots, C = capacity.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark.modeling import cpu_kernels
from dspark.modeling.kv_cache import BLOCK, KVCache, KVPool

#: most float32 score elements one matmul may produce; longer query blocks are split into row chunks
_MAX_SCORES = 1 << 24
#: bfloat16 on the CPU through torch's fused kernel (``fused_cpu_attention``); False: the block-split path for every
#: dtype (scripts/fused_attention.py compares the two)
FUSED_CPU_ATTENTION = True
#: requests with more query rows than this (prefill pieces) attend on their own: padding every request's queries
#: to the longest piece would multiply the work, and a prefill piece is heavy enough to pay a call of its own
LONG_QUERY = 16
#: the fewest query rows the fused CPU path sends SDPA (module doc): a decode step's g rows are repeated up to it
MIN_ROWS = 4


@dataclass
class BatchLayout:
    """Where each token of a flattened batch sits; built once per forward, shared by every layer."""

    seq_lens: list[int]  # (R,) query rows per request
    positions: torch.Tensor  # (N,) absolute position of each token
    token_req: torch.Tensor  # (N,) request of each token
    token_row: torch.Tensor  # (N,) row of each token inside its request
    q_positions: torch.Tensor  # (R, T) absolute position of each padded query row
    kv_len: int  # S: the longest request's keys rounded up to BLOCK (the GPU path's padded block)
    uniform: bool  # every request has T rows: padding is a reshape
    pool: KVPool | None = None  # the caches' pool (None: fresh sequences, keys are the batch's own)
    slots: torch.Tensor | None = None  # (R,) slot of each request
    slot_range: tuple[int, int] | None = None  # (first, R) when the slots are consecutive: a view, no gather
    causal: bool = True  # False: every row sees all of its request's keys (a draft block's own slots too)
    ends: torch.Tensor | None = None  # (R,) one past each request's last key
    block_req: torch.Tensor | None = None  # (B,) request of each key block read
    block_slot: torch.Tensor | None = None  # (B,) its slot (row of the key source)
    block_index: torch.Tensor | None = None  # (B,) its index inside the slot (positions index*L .. index*L+L-1)
    single_slot: int | None = None  # the slot when the layout has one request (its blocks are then a view)
    key_lens: list[int] = field(default_factory=list)  # (R,) keys each request reads, whole blocks (<= kv_len)
    slot_list: list[int] = field(default_factory=list)  # (R,) ``slots`` on the host
    _masks: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def rows(self) -> int:  # T
        return self.q_positions.shape[1]

    @classmethod
    def build(cls, seq_lens: list[int], caches: list[KVCache] | None, device: torch.device,
              pooled: bool = True, causal: bool = True) -> "BatchLayout":
        """``pooled=False``: positions only (the per-request reference path reads the caches itself)."""
        R = len(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.long)  # (R,) metadata is built on the host, then moved
        starts = torch.tensor([c.length for c in caches] if caches is not None else [0] * R, dtype=torch.long)
        token_req = torch.repeat_interleave(torch.arange(R), lens)  # (N,)
        token_row = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens)[token_req]  # (N,)
        T = max(seq_lens)
        q_positions = starts[:, None] + torch.arange(T)[None, :]  # (R, T)
        layout = cls(
            seq_lens=seq_lens, positions=(starts[token_req] + token_row).to(device),
            token_req=token_req.to(device), token_row=token_row.to(device), q_positions=q_positions.to(device),
            kv_len=T, uniform=min(seq_lens) == T, causal=causal, ends=(starts + lens).to(device),
        )
        if caches is not None and pooled:
            pool = caches[0].pool
            slots = [c.slot for c in caches]
            layout.pool = pool
            layout.kv_len = min(-(-int((starts + lens).max()) // BLOCK) * BLOCK, pool.capacity)
            slot_ids = torch.tensor(slots, dtype=torch.long)
            if slots == list(range(slots[0], slots[0] + R)):
                layout.slot_range = (slots[0], R)
        else:  # keys are the batch's own, padded: request r is row r
            slot_ids = torch.arange(R)
            layout.kv_len = -(-T // BLOCK) * BLOCK
        layout.slots = slot_ids.to(device)
        layout.slot_list = slot_ids.tolist()
        layout.single_slot = int(slot_ids[0]) if R == 1 else None
        blocks = -(-(starts + lens) // BLOCK)  # (R,) key blocks per request
        layout.key_lens = (blocks * BLOCK).clamp_max(layout.kv_len).tolist()  # (R,) keys each request reads
        block_req = torch.repeat_interleave(torch.arange(R), blocks)  # (B,)
        layout.block_req = block_req.to(device)
        layout.block_slot = slot_ids[block_req].to(device)
        layout.block_index = (torch.arange(int(blocks.sum())) - (blocks.cumsum(0) - blocks)[block_req]).to(device)
        return layout

    def mask(self, window: int | None) -> torch.Tensor:  # (R, T, S) bool, True = may attend
        if window not in self._masks:
            k_pos = torch.arange(self.kv_len, device=self.q_positions.device)
            q_pos = self.q_positions[:, :, None]  # (R, T, 1)
            if self.causal:
                allowed = k_pos[None, None, :] <= q_pos
            else:  # (R, 1, S), broadcast over the rows
                allowed = (k_pos[None, None, :] < self.ends[:, None, None]).expand(-1, self.rows, -1)
            if window is not None:
                allowed &= k_pos[None, None, :] > q_pos - window
            self._masks[window] = allowed
        return self._masks[window]

    def row_mask(self, window: int | None, group: int) -> torch.Tensor:  # (R, 1, M, S) bool, M = fused_rows(...)
        """``mask`` with each row repeated for the ``group`` query heads that share a KV head (rows (g, t), as
        ``fused_cpu_attention`` folds them), the (g, t) rows repeated as a whole up to ``MIN_ROWS``."""
        key = ("rows", window, group)
        if key not in self._masks:
            R, T = self.num_requests, self.rows
            rows = fused_rows(group * T)
            self._masks[key] = self.mask(window)[:, None, None].expand(R, 1, rows // T, T, self.kv_len).reshape(
                R, 1, rows, self.kv_len)
        return self._masks[key]

    def row_bias(self, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:  # (R, 1, M, S)
        """``row_mask`` as the additive mask SDPA turns a boolean one into (0 where a row may attend, -inf
        elsewhere, in the queries' dtype), built once per forward instead of once per layer and call."""
        key = ("row bias", window, group, dtype)
        if key not in self._masks:
            allowed = self.row_mask(window, group)
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._masks[key]

    def block_bias(self, window: int | None) -> torch.Tensor:  # (B, 1, 1, T, L) float32: 0 = may attend, -inf
        key = ("bias", window)
        if key not in self._masks:
            bias = torch.zeros(self.block_mask(window).shape, device=self.block_index.device)
            self._masks[key] = bias.masked_fill_(~self.block_mask(window), float("-inf"))[:, None, None]
        return self._masks[key]

    def block_mask(self, window: int | None) -> torch.Tensor:  # (B, T, L) bool, True = may attend
        key = ("blocks", window)
        if key not in self._masks:
            k_pos = self.block_index[:, None] * BLOCK + torch.arange(BLOCK, device=self.block_index.device)  # (B, L)
            q_pos = self.q_positions[self.block_req][:, :, None]  # (B, T, 1)
            if self.causal:
                allowed = k_pos[:, None, :] <= q_pos
                if window is not None:
                    allowed &= k_pos[:, None, :] > q_pos - window
            else:
                allowed = (k_pos < self.ends[self.block_req][:, None])[:, None, :].expand(-1, self.rows, -1)
            self._masks[key] = allowed
        return self._masks[key]

    def kernel_ranges(self, window: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # (N,), (N,), (R+1,), work
        """What ``cpu_kernels.attention`` reads, once per forward: the positions lo .. hi-1 each token reads (its
        mask's allowed keys), the requests' token offsets and the kernel's scratch."""
        key = ("kernel", window)
        if key not in self._masks:
            pos = self.positions  # (N,)
            hi = pos + 1 if self.causal else self.ends[self.token_req]  # (N,)
            lo = (pos - window + 1).clamp_min(0) if window is not None else torch.zeros_like(pos)
            offsets = torch.tensor([0, *itertools.accumulate(self.seq_lens)], dtype=torch.long)  # (R+1,)
            last = int(hi.max()) if pos.numel() else 0
            self._masks[key] = (lo.contiguous(), hi.contiguous(), offsets, cpu_kernels.attention_work(last))
        return self._masks[key]

    def pad_rows(self, x: torch.Tensor) -> torch.Tensor:  # (N, ...) -> (R, T, ...)
        R, T = self.num_requests, self.rows
        if self.uniform:
            return x.view(R, T, *x.shape[1:])
        out = x.new_zeros(R, T, *x.shape[1:])
        out[self.token_req, self.token_row] = x
        return out

    def unpad_rows(self, x: torch.Tensor) -> torch.Tensor:  # (R, T, ...) -> (N, ...)
        if self.uniform:
            return x.reshape(-1, *x.shape[2:])
        return x[self.token_req, self.token_row]

    def store_and_read(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,  # (N, Hkv, D) x2
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values (P, Hkv, C, D): row block_slot[b] holds block b
        """Write the batch's new keys/values into the pool (or pad them, without a pool) and return where the
        key blocks are read from."""
        if self.pool is None:
            S = self.kv_len
            keys = k.new_zeros(self.num_requests, S, *k.shape[1:])  # (R, S, Hkv, D)
            values = torch.zeros_like(keys)
            keys[self.token_req, self.token_row] = k
            values[self.token_req, self.token_row] = v
            return keys.transpose(1, 2), values.transpose(1, 2)
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]  # (P, Hkv, C, D)
        if "slot_of_token" not in self._masks:  # once per forward, shared by the layers
            self._masks["slot_of_token"] = self.slots[self.token_req]  # (N,)
        slot_of_token = self._masks["slot_of_token"]
        keys[slot_of_token, :, self.positions] = k
        values[slot_of_token, :, self.positions] = v
        return keys, values

    def padded(self, source: torch.Tensor) -> torch.Tensor:  # (P, Hkv, C, D) -> (R, Hkv, S, D)
        """Each request's first S keys (the GPU path's SDPA block): a view when the slots are consecutive."""
        S = self.kv_len
        if self.slot_range is not None:
            first, R = self.slot_range
            return source[first : first + R, :, :S]
        return source[:, :, :S].index_select(0, self.slots)


@dataclass
class AttentionPart:
    """Requests attended in one call: their tokens' indices in the flat batch (None = all) and their layout."""

    tokens: torch.Tensor | slice | None  # (n,) int64 or a slice of the N tokens
    layout: BatchLayout
    kernel: bool = False  # through the C kernel (``cpu_kernels.attention``), else torch's path (``batched_attention``)


def plan_attention(seq_lens: list[int], caches: list[KVCache] | None, device: torch.device) -> list[AttentionPart]:
    """One part for all requests of at most ``LONG_QUERY`` rows (decode and verify blocks), one part per longer
    request (prefill pieces). A decode or verify step is always one part: one attention call per layer."""
    long = [r for r, n in enumerate(seq_lens) if n > LONG_QUERY]
    if len(long) == 0 or len(seq_lens) == 1:
        return [AttentionPart(None, BatchLayout.build(seq_lens, caches, device))]
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n)
    parts = []
    short = [r for r, n in enumerate(seq_lens) if n <= LONG_QUERY]
    if short:
        index = torch.cat([torch.arange(offsets[r], offsets[r + 1]) for r in short]).to(device)
        parts.append(AttentionPart(index, BatchLayout.build(
            [seq_lens[r] for r in short], None if caches is None else [caches[r] for r in short], device)))
    for r in long:
        parts.append(AttentionPart(slice(offsets[r], offsets[r + 1]), BatchLayout.build(
            [seq_lens[r]], None if caches is None else [caches[r]], device)))
    return parts


def plan_kernel_attention(seq_lens: list[int], caches: list[KVCache] | None, device: torch.device,
                          prompt_from: int | None = None) -> list[AttentionPart]:
    """The plan with the C kernel on: the decode and verify rows of every request in one kernel part, and the prompt
    pieces (requests ``prompt_from`` on; None: none) through torch's fused attention, as ``plan_attention`` parts
    them, where ``cpu_kernels.prompts_to_kernel`` is False (CPUs with AMX tiles: there torch's kernel multiplies
    whole tiles and is 1.5x faster per prompt, docs/reports/cpu-attention-kernel.md §Prompts); elsewhere the prompt
    pieces join the kernel's one part. The split is by what a request is, never by its length, so a prompt's rows
    take one path however it is cut into pieces and a decoding row one path whatever else the pass holds."""
    R = len(seq_lens)
    prompt_from = R if prompt_from is None or cpu_kernels.prompts_to_kernel() else max(0, min(prompt_from, R))
    if prompt_from == R:
        return [AttentionPart(None, BatchLayout.build(seq_lens, caches, device), kernel=True)]
    n0 = sum(seq_lens[:prompt_from])
    parts = []
    if prompt_from:
        parts.append(AttentionPart(slice(0, n0), BatchLayout.build(
            seq_lens[:prompt_from], None if caches is None else caches[:prompt_from], device), kernel=True))
    for part in plan_attention(seq_lens[prompt_from:], None if caches is None else caches[prompt_from:], device):
        tokens = part.tokens
        if tokens is None:
            tokens = slice(n0, n0 + sum(seq_lens[prompt_from:]))
        elif isinstance(tokens, slice):
            tokens = slice(tokens.start + n0, tokens.stop + n0)
        else:
            tokens = tokens + n0
        parts.append(AttentionPart(tokens if n0 else part.tokens, part.layout))
    return parts


def plan_forward(
    seq_lens: list[int], caches: list[KVCache] | None, device: torch.device, *, per_request: bool = False,
    kernel: bool = False, prompt_from: int | None = None,
) -> tuple[list[AttentionPart] | None, BatchLayout]:
    """A forward's attention plan and the layout its positions come from: no parts (``per_request``, or caches of
    different pools: each request attends alone, ``decoder.attend_per_request``), the C kernel's plan
    (``kernel``: ``plan_kernel_attention`` with ``prompt_from``), else ``plan_attention``'s."""
    if per_request or (caches is not None and any(c.pool is not caches[0].pool for c in caches)):
        parts = None
    elif kernel:
        parts = plan_kernel_attention(seq_lens, caches, device, prompt_from)
    else:
        parts = plan_attention(seq_lens, caches, device)
    whole = parts is not None and parts[0].tokens is None  # a part holding every request has the positions already
    layout = parts[0].layout if whole else BatchLayout.build(seq_lens, caches, device, pooled=False)
    return parts, layout


def attend_parts(
    parts: list[AttentionPart], layer_idx: int,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # (N, Hq, D), (N, Hkv, D) x2
    scale: float, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # (N, Hq*D)
    """Store the layer's new keys/values and attend, one call per part (one in a decode or verify step)."""
    if len(parts) == 1 and parts[0].tokens is None:
        keys, values = parts[0].layout.store_and_read(layer_idx, k, v)
        return _attend_part(parts[0], q, keys, values, scale, window, softcap)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for part in parts:
        sel = part.tokens
        keys, values = part.layout.store_and_read(layer_idx, k[sel], v[sel])
        out[sel] = _attend_part(part, q[sel], keys, values, scale, window, softcap)
    return out


def _attend_part(part: AttentionPart, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:  # (n, Hq*D)
    if part.kernel:
        lo, hi, offsets, work = part.layout.kernel_ranges(window)
        return cpu_kernels.attention(q, keys, values, part.layout.slots, offsets, lo, hi, scale, work)
    return batched_attention(q, keys, values, part.layout, scale, window, softcap)


def batched_attention(
    q: torch.Tensor,  # (N, Hq, D)
    keys: torch.Tensor,  # (P, Hkv, C, D) from store_and_read
    values: torch.Tensor,  # (P, Hkv, C, D)
    layout: BatchLayout,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # (N, Hq*D)
    P, Hkv, C, D = keys.shape
    Hq, T, R = q.shape[1], layout.rows, layout.num_requests
    g = Hq // Hkv
    qp = layout.pad_rows(q)  # (R, T, Hq, D)
    if q.is_cuda and softcap is None:  # fused kernels over the padded block
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), layout.padded(keys), layout.padded(values), attn_mask=layout.mask(window)[:, None],
            scale=scale, enable_gqa=g > 1,
        ).transpose(1, 2)  # (R, T, Hq, D)
        return layout.unpad_rows(out.reshape(R, T, Hq * D))
    if (FUSED_CPU_ATTENTION and q.dtype == torch.bfloat16 and softcap is None
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return fused_cpu_attention(q, keys, values, layout, scale, window)
    B = layout.block_req.shape[0]
    one = layout.single_slot  # one request (a lone stream, a prefill piece): its blocks are a view of its slot
    if one is not None:
        k_one = keys[one, :, : B * BLOCK]  # (Hkv, B*L, D)
        vb = values[one, :, : B * BLOCK].view(Hkv, B, BLOCK, D).transpose(0, 1)  # (B, Hkv, L, D)
    else:  # the key blocks every request reads, gathered from the pool: (B, Hkv, L, D)
        kb = keys.view(P, Hkv, C // BLOCK, BLOCK, D)[layout.block_slot, :, layout.block_index]
        vb = values.view(P, Hkv, C // BLOCK, BLOCK, D)[layout.block_slot, :, layout.block_index]
    # grouped queries: query head h reads KV head h // g, so (Hq, T) rows become (Hkv, g*T) rows, no K/V repeat
    qg = qp.view(R, T, Hkv, g, D).permute(0, 2, 3, 1, 4)  # (R, Hkv, g, T, D)
    bias = layout.block_bias(window)  # (B, 1, 1, T, L)
    chunk = max(1, _MAX_SCORES // max(1, B * Hkv * g * BLOCK))  # query rows per pass (long prefill pieces)
    outs = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        t = t1 - t0
        if one is not None:  # one matmul over the slot, cut into blocks: bitwise the per-block products
            q_one = qg[0, :, :, t0:t1].reshape(Hkv, g * t, D)
            scores = (q_one @ k_one.transpose(-1, -2)).view(Hkv, g * t, B, BLOCK).permute(2, 0, 1, 3) * scale
        else:
            qb = qg[:, :, :, t0:t1][layout.block_req].reshape(B, Hkv, g * t, D)  # (B, Hkv, g*t, D)
            scores = (qb @ kb.transpose(-1, -2)) * scale  # (B, Hkv, g*t, L)
        if softcap is not None:  # Gemma2 soft-capping
            scores = torch.tanh(scores / softcap) * softcap
        scores = torch.add(scores.reshape(B, Hkv, g, t, BLOCK), bias[..., t0:t1, :])  # float32, -inf where masked
        # m_b, kept finite where a row sees nothing of the block (its weights and rescale are then exactly 0);
        # detached: the output does not depend on the shift m_b (it cancels between o_b and l_b), so neither does
        # its gradient, and autograd (the draft LM trains through this) needs no in-place-free copy of it
        block_max = scores.detach().amax(-1).clamp_min_(-1e30)  # (B, Hkv, g, t)
        weights = torch.exp(scores - block_max[..., None])  # (B, Hkv, g, t, L), 0 where masked
        block_sum = weights.sum(-1)  # (B, Hkv, g, t) l_b
        block_out = (weights.to(q.dtype).view(B, Hkv, g * t, BLOCK) @ vb).view(B, Hkv, g, t, D).float()  # o_b
        # combine each request's blocks: M = max_b m_b, out = Σ exp(m_b - M) o_b / Σ exp(m_b - M) l_b
        req_max = block_max.new_full((R, Hkv, g, t), float("-inf"))
        req_max.scatter_reduce_(0, layout.block_req[:, None, None, None].expand_as(block_max), block_max, "amax")
        rescale = torch.exp(block_max - req_max[layout.block_req])  # (B, Hkv, g, t), 0 for blocks seen not at all
        total = torch.zeros_like(req_max).index_add_(0, layout.block_req, rescale * block_sum)  # (R, Hkv, g, t)
        summed = block_out.new_zeros(R, Hkv, g, t, D).index_add_(0, layout.block_req, rescale[..., None] * block_out)
        outs.append((summed / total[..., None]).to(q.dtype))  # (R, Hkv, g, t, D)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)  # (R, Hkv, g, T, D)
    return layout.unpad_rows(out.permute(0, 3, 1, 2, 4).reshape(R, T, Hq * D))


def fused_cpu_attention(
    q: torch.Tensor,  # (N, Hq, D) bfloat16
    keys: torch.Tensor,  # (P, Hkv, C, D) from store_and_read (the pool), or (R, Hkv, S, D) without a pool
    values: torch.Tensor,
    layout: BatchLayout,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # (N, Hq*D)
    """Torch's fused CPU attention over each request's first S keys, load-independent in bfloat16 (module doc).

    Query head h reads KV head h // g, so the g query heads of a KV head become g*T rows of one head: the kernel
    multiplies at least g rows at once, and fewer than ``MIN_ROWS`` rows (a decode step's g*T) are repeated up to it:
    a small product would take another kernel and round otherwise."""
    Hkv, D = keys.shape[1], keys.shape[3]
    Hq, T, R = q.shape[1], layout.rows, layout.num_requests
    g = Hq // Hkv
    qf = layout.pad_rows(q).view(R, T, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, g * T, D)  # rows (g, t)
    mask = layout.row_bias(window, g, q.dtype)  # (R, 1, M, S), M = fused_rows(g*T): 0 or -inf (SDPA's bool mask)
    if qf.shape[2] < mask.shape[2]:  # too few rows: the (g, t) rows repeated as a whole
        qf = qf.repeat(1, 1, mask.shape[2] // qf.shape[2], 1)
    groups = key_groups(layout)
    if len(groups) == 1 and groups[0].requests is None:  # the whole batch in one call
        out = F.scaled_dot_product_attention(qf, *_group_keys(keys, values, groups[0]),
                                             attn_mask=mask[..., : groups[0].keys], scale=scale)  # (R, Hkv, M, D)
    else:
        out = qf.new_empty(R, Hkv, mask.shape[2], D)
        key = ("group masks", window, g)  # each group's rows of the mask, gathered once per forward
        if key not in layout._masks:
            layout._masks[key] = [mask[grp.requests, :, :, : grp.keys] for grp in groups]
        for grp, grp_mask in zip(groups, layout._masks[key]):  # runs of consecutive slots: views of the pool, no copy
            k, v = _group_keys(keys, values, grp)
            out[grp.requests] = F.scaled_dot_product_attention(qf[grp.requests], k, v, attn_mask=grp_mask, scale=scale)
    out = out[:, :, : g * T].reshape(R, Hkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(R, T, Hq * D)
    return layout.unpad_rows(out)


def fused_rows(rows: int) -> int:
    """The query rows the fused CPU path sends for ``rows`` folded rows: whole repeats of them, at least
    ``MIN_ROWS``."""
    return rows * -(-MIN_ROWS // rows)


#: what one more fused-attention call costs, in keys read (measured on SmolLM2's heads, one thread: ~16 us)
CALL_KEYS = 192


@dataclass(frozen=True)
class KeyGroup:
    """Requests attended in one fused call: a run of consecutive slots, each request reading ``keys`` keys."""

    requests: torch.Tensor | None  # (count,) their rows of the batch, in slot order (None: all, already so)
    first_slot: int
    count: int
    keys: int  # the longest request's keys, whole blocks: the others' extra keys are masked


@functools.cache
def padding_invariant() -> bool:
    """Whether torch's fused bf16 CPU attention gives a row the same bits however many masked keys pad it, on
    this CPU (probed once per process: 3 heads, 24 rows, 300 keys read as 320, 512 and 960). The Intel AMX parts
    the fused path was measured on passed the bitwise split tests this stands for; an AVX512-BF16 AMD EPYC does
    not (there 320 and 576 keys agree, 512 and 960 do not). Where it is false, ``key_groups`` gives each request a
    call of its own, over its own keys only."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 24, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 3, 960, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    outs = []
    for keys in (320, 512, 960):
        mask = torch.full((1, 1, 24, keys), float("-inf"), dtype=torch.bfloat16)
        mask[..., :300] = 0
        outs.append(F.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], attn_mask=mask, scale=0.125))
    return all(torch.equal(outs[0], o) for o in outs[1:])


def key_groups(layout: BatchLayout) -> list[KeyGroup]:
    """How the fused path splits the batch, once per forward (every layer uses it).

    The kernel skips no masked key, so a call costs (requests x the longest request's keys) plus a fixed cost
    (``CALL_KEYS``), and a call's keys must be one view of the pool: consecutive slots. The batch is sorted by
    slot, cut into runs of consecutive slots, and each run into the segments that minimise that cost (dynamic
    programming over the run: a lone 900-key request among 60-key ones gets a call of its own). The split is about
    speed only: every row gets the same bits in any group (module doc) where ``padding_invariant()``; elsewhere
    every request is a group of its own, so that a row's bits depend on its own request only."""
    if "key_groups" in layout._masks:
        return layout._masks["key_groups"]
    slots, lens = layout.slot_list, layout.key_lens
    R = len(slots)
    if not padding_invariant():
        groups = ([KeyGroup(None, slots[0], 1, lens[0])] if R == 1 else
                  [KeyGroup(torch.tensor([r]), slots[r], 1, lens[r]) for r in sorted(range(R), key=slots.__getitem__)])
        layout._masks["key_groups"] = groups
        return groups
    order = sorted(range(R), key=lambda r: slots[r])
    runs, run = [], [order[0]]
    for r in order[1:]:
        if slots[r] == slots[run[-1]] + 1:
            run.append(r)
        else:
            runs.append(run)
            run = [r]
    runs.append(run)
    groups = []
    for run in runs:
        n = len(run)
        best = [0.0] + [float("inf")] * n  # best[i]: cheapest split of run[:i]; cut[i]: where its last segment starts
        cut = [0] * (n + 1)
        for i in range(1, n + 1):
            longest = 0
            for j in range(i - 1, -1, -1):  # the last segment is run[j:i]
                longest = max(longest, lens[run[j]])
                cost = best[j] + CALL_KEYS + (i - j) * longest
                if cost < best[i]:
                    best[i], cut[i] = cost, j
        i, segments = n, []
        while i > 0:
            segments.append(run[cut[i] : i])
            i = cut[i]
        for seg in reversed(segments):
            groups.append(KeyGroup(torch.tensor(seg), slots[seg[0]], len(seg), max(lens[r] for r in seg)))
    if len(groups) == 1 and order == list(range(R)):
        groups = [KeyGroup(None, slots[0], R, groups[0].keys)]
    layout._masks["key_groups"] = groups
    return groups


def _group_keys(keys: torch.Tensor, values: torch.Tensor, group: KeyGroup
                ) -> tuple[torch.Tensor, torch.Tensor]:  # (count, Hkv, keys, D) x2, views of the pool
    sl = slice(group.first_slot, group.first_slot + group.count)
    return keys[sl, :, : group.keys], values[sl, :, : group.keys]
