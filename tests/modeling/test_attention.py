"""Batched attention over the KV pool (dspark.modeling.attention, dspark.modeling.kv_cache).

The batched path must compute what the per-request reference loop computes (float32, tight tolerance), a
decode step must be one attention call per layer, and in bfloat16 a request's rows must come out bitwise the
same whatever else is in the batch and however its prompt is cut into prefill pieces (load independence).
"""

from __future__ import annotations

import gc

import pytest
import torch

from dspark.modeling import attention as attention_mod
from dspark.modeling.attention import BatchLayout, batched_attention
from dspark.modeling.kv_cache import BLOCK, KVPool
from tests.tiny import tiny_target


def _ids(n: int, seed: int, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode_batch(target, prompts: list[torch.Tensor], steps: list[list[int]]) -> list[torch.Tensor]:
    """Prefill ``prompts`` together, then one forward per entry of ``steps`` (rows per request); logits."""
    caches = [target.new_cache(8) for _ in prompts]
    out = [target.forward(torch.cat(prompts), [len(p) for p in prompts], caches).logits]
    for i, lens in enumerate(steps):
        ids = torch.cat([_ids(n, 100 * i + r) for r, n in enumerate(lens)])
        out.append(target.forward(ids, lens, caches, [0, 2]).logits)
    return out


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 6, "model_type": "mistral"}])
def test_batched_attention_matches_the_per_request_loop(overrides):
    target = tiny_target(seed=3, **overrides)
    prompts = [_ids(n, n) for n in (5, 23, 2, 9)]  # one prompt longer than LONG_QUERY: a part of its own
    steps = [[1, 1, 1, 1], [3, 1, 8, 2], [1, 4, 1, 1]]  # decode, then verify blocks of different lengths
    batched = _decode_batch(target, prompts, steps)
    target.model.model.attention = "per-request"
    reference = _decode_batch(target, prompts, steps)
    for got, want in zip(batched, reference):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_decode_step_is_one_attention_call_per_layer(monkeypatch):
    target = tiny_target(seed=1)
    caches = [target.new_cache(8) for _ in range(5)]
    target.forward(torch.cat([_ids(n, n) for n in (3, 30, 7, 1, 12)]), [3, 30, 7, 1, 12], caches)
    calls = []
    real = attention_mod.batched_attention
    monkeypatch.setattr(attention_mod, "batched_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    target.forward(_ids(12, 9), [1, 2, 8, 1], caches[:4])  # a verify step
    assert len(calls) == target.num_layers and calls[0][0] == 12  # every token of the batch in one call
    assert len({c.slot for c in caches}) == 5 and {c.pool for c in caches} == {target.model.kv_pool}


def _attend_over_the_padded_batch(q, keys, values, layout, scale):  # (N, Hq, D) -> (N, Hq*D)
    """The obvious batched attention, for the negative control: one softmax and one matmul over the batch's
    longest key length (what each row sees then depends on its neighbours)."""
    k, v = layout.padded(keys), layout.padded(values)  # (R, Hkv, S, D)
    R, Hkv, S, D = k.shape
    qp = layout.pad_rows(q).transpose(1, 2)  # (R, Hq, T, D)
    g, T = qp.shape[1] // Hkv, qp.shape[2]
    scores = (qp.reshape(R, Hkv, g * T, D) @ k.transpose(-1, -2)).view(R, Hkv, g, T, S) * scale
    probs = scores.masked_fill(~layout.mask(None)[:, None, None], float("-inf")).softmax(-1).to(q.dtype)
    out = (probs.view(R, Hkv, g * T, S) @ v).view(R, Hkv * g, T, D).transpose(1, 2)  # (R, T, Hq, D)
    return layout.unpad_rows(out.reshape(R, T, -1))


def _fused_over_the_padded_batch(q, keys, values, layout, scale):  # (N, Hq, D) -> (N, Hq*D)
    """The obvious fused attention, for the negative control: SDPA over the batch's padded block, one query head
    per head (float32 matmuls of different shapes round a row differently)."""
    k, v = layout.padded(keys), layout.padded(values)  # (R, Hkv, S, D)
    R, T = layout.num_requests, layout.rows
    qp = layout.pad_rows(q).transpose(1, 2)  # (R, Hq, T, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        qp, k, v, attn_mask=layout.mask(None)[:, None], scale=scale, enable_gqa=True)  # (R, Hq, T, D)
    return layout.unpad_rows(out.transpose(1, 2).reshape(R, T, -1))


def _attend_alone_and_among(dtype: torch.dtype, trial: int, attend=batched_attention
                            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One request's attention output alone, and among random neighbours (before and after it)."""
    g = torch.Generator().manual_seed(trial)
    Hkv, Hq, D = 3, 9, 64
    ctx, n = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    others = [(int(torch.randint(1, 500, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
              for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
    keys, values, queries = (torch.randn(600, h, D, generator=g).to(dtype) for h in (Hkv, Hkv, Hq))

    def run(reqs: list[tuple[int, int]]) -> torch.Tensor:
        pool = KVPool(1, Hkv, D, len(reqs), 600, dtype)
        caches = [pool.allocate() for _ in reqs]
        for c, (length, _) in zip(caches, reqs):
            pool.keys[0, c.slot, :, :length] = keys[:length].transpose(0, 1)
            pool.values[0, c.slot, :, :length] = values[:length].transpose(0, 1)
            c.length = length
        layout = BatchLayout.build([m for _, m in reqs], caches, torch.device("cpu"))
        new = [torch.cat([t[s : s + m] for s, m in reqs]) for t in (queries, keys, values)]
        k_all, v_all = layout.store_and_read(0, new[1], new[2])
        return attend(new[0], k_all, v_all, layout, D**-0.5)

    among = []
    for where in (0, len(others)):
        reqs = others[:where] + [(ctx, n)] + others[where:]
        first = sum(m for _, m in reqs[:where])
        among.append(run(reqs)[first : first + n])
    return run([(ctx, n)]), among


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_rest_of_the_batch(dtype):
    for trial in range(12):
        alone, among = _attend_alone_and_among(dtype, trial)
        for got in among:
            assert torch.equal(got, alone), trial


def test_the_same_check_sees_rows_move_over_a_padded_batch():
    """Negative control: attention over the batch's longest key length (one softmax and one matmul, or the fused
    kernel with a head per query head) rounds a row differently next to longer neighbours in float32 on some
    CPUs' kernels and not on others, so both are tried; the comparison above catches a move (it is not blind)."""
    moved = 0
    for attend in (_attend_over_the_padded_batch, _fused_over_the_padded_batch):
        for trial in range(12):
            alone, among = _attend_alone_and_among(torch.float32, trial, attend)
            moved += sum(not torch.equal(got, alone) for got in among)
    assert moved > 0


def test_bf16_prefill_in_pieces_gives_the_rows_of_a_whole_prompt():
    target = tiny_target(seed=2)
    target.model.to(torch.bfloat16)
    target.model.model.batch_invariant = True
    prompt = _ids(41, 7)
    whole, pieces = target.new_cache(8), target.new_cache(8)
    ref = target.forward(prompt, [41], [whole], [1, 3], logits_for="all")
    got = [target.forward(prompt[a:b], [b - a], [pieces], [1, 3], logits_for="all") for a, b in
           ((0, 20), (20, 21), (21, 37), (37, 41))]
    assert torch.equal(torch.cat([o.logits for o in got]), ref.logits)
    assert torch.equal(torch.cat([o.features for o in got]), ref.features)
    L = whole.length
    assert torch.equal(pieces.keys[:, :, :L], whole.keys[:, :, :L])


def test_pool_slots_are_reused_and_growth_keeps_the_contents():
    target = tiny_target(seed=4)
    a, b = target.new_cache(8), target.new_cache(8)
    target.forward(torch.cat([_ids(5, 1), _ids(3, 2)]), [5, 3], [a, b])
    kept = a.keys[:, :, :5].clone()
    pool = target.model.kv_pool
    assert pool.capacity % BLOCK == 0 and pool.bytes_per_token == 2 * 4 * 2 * 8 * 4
    c = target.new_cache(3 * BLOCK)  # more room than the pool had: every slot grows
    assert pool.capacity >= 3 * BLOCK and torch.equal(a.keys[:, :, :5], kept)
    slot = b.slot
    del b
    gc.collect()
    assert target.new_cache(8).slot == slot  # a dropped handle gives its slot back
    c.release()
    c.release()  # idempotent
    assert pool.slots_in_use == 1  # a alone


def test_reserve_sizes_the_pool_in_one_copy_and_keeps_the_contents():
    pool = KVPool(2, 1, 4, slots=1, capacity=64, max_length=1000)
    cache = pool.allocate()
    pool.keys[:, cache.slot, :, :3] = 7.0
    pool.reserve(5, 130)
    assert (pool.num_slots, pool.capacity) == (5, 192) and torch.all(pool.keys[:, cache.slot, :, :3] == 7.0)
    pool.reserve(2, 64)  # never shrinks
    assert (pool.num_slots, pool.capacity) == (5, 192)
    pool.reserve(5, 5000)  # capped at the model's context, in whole blocks
    assert pool.capacity == 1024


def test_gradients_through_batched_attention_match_the_per_request_loop():
    """The draft LM trains through this attention: its gradients must be the reference loop's (the block
    maxima are detached, which is exact because the output does not depend on them)."""
    def grads(mode: str) -> dict[str, torch.Tensor]:
        target = tiny_target(seed=4)
        model = target.model
        model.model.attention = mode
        for p in model.parameters():
            p.requires_grad_(True)
        ids = torch.cat([_ids(n, n) for n in (7, 19, 3)])
        hidden, _ = model.model(ids, [7, 19, 3], None, None)  # (N, H), a fresh sequence each, as in training
        (hidden.pow(2).sum() + model.logits(hidden).logsumexp(-1).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    batched, reference = grads("batched"), grads("per-request")
    assert batched.keys() == reference.keys() and len(batched) > 4
    for name in reference:
        torch.testing.assert_close(batched[name], reference[name], atol=1e-4, rtol=1e-4, msg=name)


def _pool_batch(lengths: list[int], rows: list[int], Hq: int, Hkv: int, seed: int, dtype=torch.bfloat16):
    """A one-layer pool holding random keys for requests of ``lengths`` cached keys, and queries/keys/values for
    ``rows`` new rows each."""
    g = torch.Generator().manual_seed(seed)
    D = 64
    pool = KVPool(1, Hkv, D, len(lengths), 1024, dtype)
    pool.keys.copy_(torch.randn(pool.keys.shape, generator=g))
    pool.values.copy_(torch.randn(pool.values.shape, generator=g))
    caches = [pool.allocate() for _ in lengths]
    for c, n in zip(caches, lengths):
        c.length = n
    N = sum(rows)
    q, k, v = (torch.randn(N, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    return caches, q, k, v


def _attend(caches, rows, q, k, v):
    layout = BatchLayout.build(rows, caches, torch.device("cpu"))
    keys, values = layout.store_and_read(0, k, v)
    return batched_attention(q, keys, values, layout, 0.125)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])  # grouped queries, and one query head per KV head
def test_bf16_decode_rows_equal_the_rows_of_a_verify_block(heads):
    """The fused path folds a KV head's query heads into rows and sends a lone row twice: a one-token step after
    p keys gives bitwise the row a verify block computes at position p (greedy speculative = plain decoding)."""
    Hq, Hkv = heads
    for trial in range(6):
        start = 5 + 97 * trial
        caches, q, k, v = _pool_batch([start], [8], Hq, Hkv, seed=trial)
        block = _attend(caches, [8], q, k, v)  # (8, Hq*D), rows at positions start..start+7
        for t in range(8):
            caches[0].length = start + t  # keys of the block's earlier rows are in the pool already
            one = _attend(caches, [1], q[t : t + 1], k[t : t + 1], v[t : t + 1])
            assert torch.equal(one[0], block[t]), (trial, t)


def test_bf16_goes_through_the_fused_kernel_and_agrees_with_the_block_split_path(monkeypatch):
    calls = []
    real = attention_mod.fused_cpu_attention
    monkeypatch.setattr(attention_mod, "fused_cpu_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    caches, q, k, v = _pool_batch([40, 300, 7, 129], [1, 8, 3, 1], 9, 3, seed=1)
    fused = _attend(caches, [1, 8, 3, 1], q, k, v)
    assert len(calls) == 1
    monkeypatch.setattr(attention_mod, "FUSED_CPU_ATTENTION", False)
    split = _attend(caches, [1, 8, 3, 1], q, k, v)
    assert len(calls) == 1  # switched off: the block-split path
    torch.testing.assert_close(fused.float(), split.float(), atol=2e-2, rtol=2e-2)  # bf16 rounding apart


@pytest.mark.parametrize("rows", [[1, 1, 1, 1], [8, 1, 3, 8]])
def test_bf16_rows_are_the_same_in_any_split_of_the_batch(monkeypatch, rows):
    """The fused path splits the batch into calls over runs of consecutive slots (``key_groups``); the split is
    about speed only: one call for all, one per request and the planned split give every row the same bits."""
    monkeypatch.setattr(attention_mod, "padding_invariant", lambda: True)  # the planner's split (next test: else)
    caches, q, k, v = _pool_batch([900, 60, 7, 300], rows, 9, 3, seed=2)
    layout = BatchLayout.build(rows, caches, torch.device("cpu"))
    planned = attention_mod.key_groups(layout)
    assert [(g.count, g.keys) for g in planned] == [(1, 960), (2, 64), (1, 320)]  # 900 and 300 keys alone
    splits = {"planned": None,
              "per request": [attention_mod.KeyGroup(torch.tensor([r]), r, 1, n)
                              for r, n in enumerate(layout.key_lens)]}
    if real_padding_invariant():  # else this CPU's fused kernel rounds by key padding: the planned groups here pad
        splits["one call"] = [attention_mod.KeyGroup(None, 0, 4, 960)]  # no request, one call pads all to 960
    outs = {}
    for name, split in splits.items():
        if split is not None:
            monkeypatch.setattr(attention_mod, "key_groups", lambda layout, split=split: split)
        outs[name] = _attend(caches, rows, q, k, v)
    assert all(torch.equal(outs["planned"], out) for out in outs.values())


real_padding_invariant = attention_mod.padding_invariant


def test_where_key_padding_moves_bits_every_request_is_attended_alone(monkeypatch):
    """A CPU whose fused kernel rounds by key padding (``padding_invariant`` false) gets one call per request,
    and each request's rows are then the bits it gets alone in the batch, whatever else the batch holds."""
    monkeypatch.setattr(attention_mod, "padding_invariant", lambda: False)
    rows = [8, 1, 3, 8]
    caches, q, k, v = _pool_batch([900, 60, 7, 300], rows, 9, 3, seed=2)
    layout = BatchLayout.build(rows, caches, torch.device("cpu"))
    assert [(g.count, g.keys) for g in attention_mod.key_groups(layout)] == [(1, 960), (1, 64), (1, 64), (1, 320)]
    batched = _attend(caches, rows, q, k, v)
    first = 0
    for r, n in enumerate(rows):
        alone = _attend([caches[r]], [n], q[first : first + n], k[first : first + n], v[first : first + n])
        assert torch.equal(batched[first : first + n], alone), r
        first += n


def test_key_groups_follow_consecutive_slots_and_lengths(monkeypatch):
    monkeypatch.setattr(attention_mod, "padding_invariant", lambda: True)
    caches, *_ = _pool_batch([100, 100, 100, 100, 100, 100], [1] * 6, 9, 3, seed=3)
    order = [caches[i] for i in (3, 4, 5, 0, 1, 2)]  # the batch in another order than its slots
    groups = attention_mod.key_groups(BatchLayout.build([1] * 6, order, torch.device("cpu")))
    assert [(g.first_slot, g.count, g.keys) for g in groups] == [(0, 6, 128)]  # equal lengths: one call
    assert groups[0].requests.tolist() == [3, 4, 5, 0, 1, 2]  # its rows in slot order
    gaps = [caches[i] for i in (0, 1, 3, 4)]  # slots 2 and 5 not in the batch
    groups = attention_mod.key_groups(BatchLayout.build([1] * 4, gaps, torch.device("cpu")))
    assert [(g.first_slot, g.count) for g in groups] == [(0, 2), (3, 2)]  # one view per run of slots


def test_the_decode_row_check_sees_an_unfolded_kernel_move(monkeypatch):
    """Negative control: the same kernel with one head per query head (a one-token step is then a one-row product)
    gives a decode row other bits than the verify block's row at its position, and the check above catches it."""
    def unfolded(q, keys, values, layout, scale, window=None):  # (N, Hq, D) -> (N, Hq*D)
        R, T = layout.num_requests, layout.rows
        out = torch.nn.functional.scaled_dot_product_attention(
            layout.pad_rows(q).transpose(1, 2), layout.padded(keys), layout.padded(values),
            attn_mask=layout.mask(window)[:, None], scale=scale, enable_gqa=True)  # (R, Hq, T, D)
        return layout.unpad_rows(out.transpose(1, 2).reshape(R, T, -1))

    monkeypatch.setattr(attention_mod, "fused_cpu_attention", unfolded)
    with pytest.raises(AssertionError):
        test_bf16_decode_rows_equal_the_rows_of_a_verify_block((9, 3))
