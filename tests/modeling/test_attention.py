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
    """Negative control: attention over the batch's longest key length (one softmax, one matmul) rounds a row
    differently next to longer neighbours in float32, and the comparison above catches it (it is not blind)."""
    moved = 0
    for trial in range(12):
        alone, among = _attend_alone_and_among(torch.float32, trial, _attend_over_the_padded_batch)
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
