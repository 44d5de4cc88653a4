"""Prepacked CPU matmuls: the same products as nn.Linear, every decoder projection packed, a clean fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.modeling.layers import fuse_projections
from dspark.modeling.packed import PackedLinear, can_pack, pack_linears
from dspark.target.model import cpu_has_bf16_matmul
from tests.tiny import tiny_target

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(8, 8)), reason="this torch build has no oneDNN packing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_nn_linear_computes(dtype, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(dtype).requires_grad_(False)
    packed = PackedLinear(lin)
    for rows in (1, 2, 5, 8, 33):
        x = torch.randn(rows, 96, dtype=dtype)
        if dtype == torch.bfloat16 and rows > 1:
            assert torch.equal(packed(x), lin(x))  # the same oneDNN kernel: bitwise (what batch invariance needs)
        else:
            torch.testing.assert_close(packed(x), lin(x), atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    x3 = torch.randn(2, 3, 96, dtype=dtype)  # leading dimensions are kept
    assert packed(x3).shape == (2, 3, 200)
    assert packed.weight is None and packed.out_features == 200


def test_few_bf16_rows_run_padded_to_min_rows_and_keep_their_bits(monkeypatch):
    """Products of fewer than MIN_ROWS bf16 rows run on MIN_ROWS rows (the kernel sees them), each row with the
    bits the unpadded product gives it on a CPU that multiplies bf16 natively (rows 2..32 share a regime there;
    docs/reports/matmul-regimes.md)."""
    import dspark.modeling.packed as packed_module

    torch.manual_seed(1)
    lin = nn.Linear(96, 200, bias=True).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(lin)
    seen = []
    kernel = packed_module._product

    def spy(rows, *args):
        seen.append(rows.shape[0])
        return kernel(rows, *args)

    monkeypatch.setattr(packed_module, "_product", spy)
    for n in (1, 2, 3, packed_module.MIN_ROWS, 9):
        x = torch.randn(n, 96, dtype=torch.bfloat16)
        got = packed(x)
        assert seen[-1] == max(n, packed_module.MIN_ROWS)  # what the kernel multiplied
        assert got.shape == (n, 200)
        bare = kernel(x, packed.packed, packed.bias)  # the unpadded product
        if n > 1 and cpu_has_bf16_matmul():  # where rows 2..32 share a regime: the same bits
            assert torch.equal(got, bare)
        else:
            torch.testing.assert_close(got, bare, atol=1e-2, rtol=1e-2)
    packed32 = PackedLinear(nn.Linear(96, 200).requires_grad_(False))
    packed32(torch.randn(2, 96))
    assert seen[-1] == 2  # float32 products run as they come


def test_pack_linears_packs_every_projection_and_keeps_the_head_weight():
    plain, packed = tiny_target(seed=4), tiny_target(seed=4)
    for t in (plain, packed):
        fuse_projections(t.model.model.layers)
    head_weight = packed.model.lm_head.weight
    assert pack_linears(packed.model)
    linears = [m for m in packed.model.modules() if isinstance(m, nn.Linear)]
    assert linears == []  # q/k/v, o, gate/up, down and the LM head all packed
    assert packed.model.lm_head.weight is head_weight  # drafters read the target's head through it
    assert packed.dtype == torch.float32 and packed.new_cache(4).keys.dtype == torch.float32
    ids = torch.randint(0, plain.vocab_size, (10,), generator=torch.Generator().manual_seed(3))
    outs = [t.forward(ids, [6, 4], None, [0, 1], logits_for="all") for t in (plain, packed)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-4, rtol=1e-4)
    assert pack_linears(packed.model)  # packing twice is a no-op


def test_a_dtype_onednn_cannot_pack_is_left_alone():
    target = tiny_target(seed=4)
    target.model.to(torch.float64)
    assert not can_pack(target.model.lm_head.weight)
    assert not pack_linears(target.model)
    assert isinstance(target.model.lm_head, nn.Linear)


def test_the_decoding_layout_is_packed_unless_asked_not_to():
    from dspark.target.model import load_target

    packed = load_target("smollm2-135m", tokenizer=False, fuse=True)
    plain = load_target("smollm2-135m", tokenizer=False, fuse=True, pack=False)
    assert isinstance(packed.model.lm_head, PackedLinear) and isinstance(plain.model.lm_head, nn.Linear)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    a, b = (t.forward(ids, [6], None, logits_for="last").logits for t in (packed, plain))
    # float32 rounding of other blocking, grown over 30 layers: ~1e-3 on logits of ~10, the same top tokens
    torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-3)
    assert torch.equal(a.topk(5).indices, b.topk(5).indices)


def test_a_packed_drafter_keeps_its_parameters_and_proposes_what_it_did():
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from dspark.modeling.packed import pack_all_linears
    from dspark.sampling.processing import SamplingParams
    from tests.drafters.tiny_drafters import LAYER_IDS, request_after, tiny_dspark

    target = tiny_target(seed=2)
    plain, packed = DSparkDrafter(tiny_dspark(target)), DSparkDrafter(tiny_dspark(target))
    names = set(packed.model.state_dict())
    assert pack_all_linears(packed.model) > 0
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert set(packed.model.state_dict()) == names  # weights and biases stay, under their names
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    blocks = [d.propose([request_after(target, [5, 9, 13, 40, 41, 42], LAYER_IDS, sp)], [4]) for d in (plain, packed)]
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    torch.testing.assert_close(blocks[1].draft_probs, blocks[0].draft_probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(blocks[1].confidence_logits, blocks[0].confidence_logits, atol=1e-5, rtol=1e-4)
