"""Training blocks (dspark.drafters.dspark.blocks) against hand-written expectations (docs/conventions.md §Blocks and slots)."""

from __future__ import annotations

import torch

from dspark.drafters.dspark.blocks import anchor_candidates, block_attention_mask, build_blocks, sample_anchors

MASK = 99


def test_anchor_candidates_need_token_and_next_token_supervised():
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0])
    # i in [0, L-2] with loss_mask[i] = loss_mask[i+1] = 1 -> 1, 2, 5
    assert anchor_candidates(loss_mask).nonzero().squeeze(-1).tolist() == [1, 2, 5]
    assert anchor_candidates(torch.tensor([1])).numel() == 0


def test_sample_anchors_sorted_distinct_reproducible_and_capped():
    loss_mask = torch.ones(50, dtype=torch.long)
    a = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(3))
    b = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(3))
    assert a.tolist() == b.tolist() == sorted(set(a.tolist()))
    assert a.numel() == 10 and int(a.max()) <= 48
    # fewer candidates than num_anchors: all of them
    small = torch.tensor([1, 1, 1, 0, 1, 1])
    assert sample_anchors(small, 64, None).tolist() == [0, 1, 4]
    assert sample_anchors(torch.zeros(6, dtype=torch.long), 4, None).numel() == 0


def test_sample_anchors_is_uniform_over_candidates():
    """Each of C candidates is picked with probability n/C; binomial bound at 5 sigma; negative control."""
    loss_mask = torch.ones(21, dtype=torch.long)  # C = 20 candidates
    n, trials = 5, 4000
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(20)
    for _ in range(trials):
        counts[sample_anchors(loss_mask, n, gen)] += 1
    p = n / 20
    sigma = (trials * p * (1 - p)) ** 0.5
    assert (counts - trials * p).abs().max() < 5 * sigma
    # negative control: always taking the first n candidates fails the same bound
    biased = torch.zeros(20)
    biased[:n] = trials
    assert (biased - trials * p).abs().max() >= 5 * sigma


def test_build_blocks_labels_prev_target_index_and_eval_mask():
    input_ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1])
    anchors = torch.tensor([1, 5])
    b = build_blocks(input_ids, loss_mask, anchors, 3, MASK)
    assert b.block_ids.tolist() == [[11, MASK, MASK], [15, MASK, MASK]]
    assert b.positions.tolist() == [[1, 2, 3], [5, 6, 7]]
    # slot k predicts anchor + k + 1; out-of-range label indices are clamped to L-1
    assert b.labels.tolist() == [[12, 13, 14], [16, 17, 17]]
    assert b.prev_tokens.tolist() == [[11, 12, 13], [15, 16, 17]]
    # p_t of slot k comes from target_last_hidden[anchor + k]
    assert b.target_index.tolist() == [[1, 2, 3], [5, 6, 7]]
    # block 0: labels at 2, 3 supervised, 4 not; block 1: 6, 7 supervised, 8 out of range
    assert b.eval_mask.tolist() == [[True, True, False], [True, True, False]]


def test_eval_mask_is_a_contiguous_prefix():
    input_ids = torch.arange(10)
    loss_mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 1, 1])  # a hole at 2
    b = build_blocks(input_ids, loss_mask, torch.tensor([0]), 5, MASK)
    # label positions 1..5: 1 ok, 2 unsupervised -> everything after is dropped too
    assert b.eval_mask.tolist() == [[True, False, False, False, False]]


def test_block_attention_mask_by_hand():
    mask = block_attention_mask(torch.tensor([1, 3]), seq_len=4, block_size=2)
    T, F = True, False
    expected = [
        # context 0..3      block 0 | block 1
        [T, F, F, F, T, T, F, F],  # block 0 (anchor 1) sees context j < 1
        [T, F, F, F, T, T, F, F],
        [T, T, T, F, F, F, T, T],  # block 1 (anchor 3) sees context j < 3
        [T, T, T, F, F, F, T, T],
    ]
    assert mask.tolist() == expected
