"""The fused CPU kernels (dspark.modeling.cpu_kernels) against the torch ops they replace, and the decoder with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.errors import DSparkError
from dspark.modeling import cpu_kernels
from dspark.modeling.layers import RMSNorm, fuse_projections, rope_tables, rotate
from dspark.modeling.packed import pack_linears
from tests.tiny import tiny_target

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler here: the torch ops run")

BF16_STEP = 2.0**-7  # one bf16 step, relative


def _bf16(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare elements one bf16 step apart (another summation order, another exp)."""
    exact = (got == want).float().mean().item()
    assert exact > 0.999, exact
    rel = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-6)).max().item()
    assert rel <= 2 * BF16_STEP, rel


def _norm(dim: int, seed: int = 1) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5 + 1
    return norm.to(torch.bfloat16)


def test_rms_norm_and_the_fused_residual_add_round_as_the_torch_ops():
    norm = _norm(576)
    x, branch = _bf16(300, 576, scale=3), _bf16(300, 576, seed=1)
    _close_in_bf16(cpu_kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
    total, normed = cpu_kernels.add_rms_norm(x, branch, norm.weight, norm.eps)
    assert torch.equal(total, x + branch)  # the add rounds once, as torch's bf16 add
    _close_in_bf16(normed, norm(x + branch))


def test_silu_mul_is_silu_of_the_gate_times_the_up_half():
    gate_up = _bf16(200, 2 * 1536, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    _close_in_bf16(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up)
    extreme = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0]]).to(torch.bfloat16)
    got = cpu_kernels.silu_mul(extreme)  # exp clamped where it would overflow: no inf, no NaN
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, F.silu(extreme[:, :5]) * extreme[:, 5:])


def test_rope_rotates_q_and_k_heads_in_place_bitwise_as_torch_and_leaves_v():
    N, Hq, Hkv, D = 40, 9, 3, 64
    qkv = _bf16(N, (Hq + 2 * Hkv) * D)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = (t.to(torch.bfloat16) for t in rope_tables(torch.arange(N) + 500, inv_freq))  # (N, 1, D) x2
    want_q = rotate(qkv[:, : Hq * D].reshape(N, Hq, D), cos, sin)
    want_k = rotate(qkv[:, Hq * D : (Hq + Hkv) * D].reshape(N, Hkv, D), cos, sin)
    got = cpu_kernels.rope_(qkv.clone(), cos.reshape(N, D), sin.reshape(N, D), Hq + Hkv, D)
    assert torch.equal(got[:, : Hq * D].reshape(N, Hq, D), want_q)
    assert torch.equal(got[:, Hq * D : (Hq + Hkv) * D].reshape(N, Hkv, D), want_k)
    assert torch.equal(got[:, (Hq + Hkv) * D :], qkv[:, (Hq + Hkv) * D :])


def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    norm = _norm(96)
    x, branch, gate_up = _bf16(33, 96, scale=2), _bf16(33, 96, seed=2), _bf16(33, 2 * 80, seed=3, scale=3)
    batch = (cpu_kernels.rms_norm(x, norm.weight, norm.eps), *cpu_kernels.add_rms_norm(x, branch, norm.weight, norm.eps),
             cpu_kernels.silu_mul(gate_up))
    for r in (0, 17, 32):
        alone = (cpu_kernels.rms_norm(x[r : r + 1], norm.weight, norm.eps),
                 *cpu_kernels.add_rms_norm(x[r : r + 1], branch[r : r + 1], norm.weight, norm.eps),
                 cpu_kernels.silu_mul(gate_up[r : r + 1]))
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, batch))


def test_the_kernels_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.silu_mul(_bf16(8, 4).t())


def _decoding_tiny(**overrides):
    target = tiny_target(seed=3, **overrides)
    target.model.to(torch.bfloat16)
    fuse_projections(target.model.model.layers)
    pack_linears(target.model)
    return target


def test_the_decoder_with_kernels_computes_what_it_computes_without():
    target = _decoding_tiny()
    assert target.model.model.use_cpu_kernels()
    ids = torch.randint(0, 96, (3 * 20,), generator=torch.Generator().manual_seed(0))
    out = {}
    for on in (False, True):
        target.model.model.cpu_kernels = on
        caches = [target.new_cache(64) for _ in range(3)]
        prefill = target.forward(ids, [20] * 3, caches, capture_layers=[1, 3])
        step = target.forward(ids[:3], [1] * 3, caches, capture_layers=[1, 3])
        out[on] = (prefill, step)
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b.logits.float(), a.logits.float(), atol=0.1, rtol=0.02)
        torch.testing.assert_close(b.features.float(), a.features.float(), atol=0.05, rtol=0.02)
        assert (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean() > 0.9


def test_a_one_token_step_gives_the_row_a_verify_block_gives_with_the_kernels():
    target = _decoding_tiny()
    target.model.model.use_cpu_kernels()
    target.model.model.batch_invariant = True
    assert target.model.model.cpu_kernels and target.batch_invariance_holds(rows=8, prompt_len=12)


def test_models_the_kernels_do_not_cover_keep_the_torch_ops():
    gemma_like = _decoding_tiny(model_type="gemma")  # norm offset, gelu: not what the kernels compute
    assert not gemma_like.model.model.use_cpu_kernels()
    plain = tiny_target(seed=3)  # q/k/v not fused: the decoding layout only
    assert not plain.model.model.use_cpu_kernels()


def test_without_a_working_compiler_decoding_keeps_the_torch_ops_with_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert cpu_kernels.load() is None and not cpu_kernels.available()
    assert "fused CPU kernels unavailable" in capsys.readouterr().err
    target = _decoding_tiny()
    assert not target.model.model.use_cpu_kernels()  # the decoder stays on the torch ops
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path / "off"))
    monkeypatch.delenv("CC")
    assert cpu_kernels.load() is None  # turned off: not even built
    assert not (tmp_path / "off").exists()


def _attention_reference(q, keys, values, slots, offsets, lo, hi, scale):  # float64, token by token
    out = []
    g = q.shape[1] // keys.shape[1]
    for r in range(len(slots)):
        for t in range(int(offsets[r]), int(offsets[r + 1])):
            k = keys[slots[r], :, lo[t]:hi[t]].double().repeat_interleave(g, 0)  # (Hq, n, D)
            v = values[slots[r], :, lo[t]:hi[t]].double().repeat_interleave(g, 0)
            w = torch.softmax((q[t].double()[:, None, :] * k).sum(-1) * scale, dim=-1)  # (Hq, n)
            out.append((w[:, :, None] * v).sum(1).reshape(-1))
    return torch.stack(out)


def _attention_batch(seq_lens, starts, heads, kv_heads, head_dim, window=None, causal=True, seed=0):
    """Random keys/values in a pool of slots (request r in slot 2r+1: not consecutive) and the kernel's inputs."""
    R, N = len(seq_lens), sum(seq_lens)
    q = _bf16(N, heads, head_dim, seed=seed)
    keys = _bf16(2 * R + 1, kv_heads, 256, head_dim, seed=seed + 1)
    values = _bf16(2 * R + 1, kv_heads, 256, head_dim, seed=seed + 2)
    slots = torch.arange(R) * 2 + 1
    offsets = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    pos = torch.cat([s + torch.arange(n) for n, s in zip(seq_lens, starts)])
    ends = torch.cat([torch.full((n,), s + n) for n, s in zip(seq_lens, starts)])
    hi = pos + 1 if causal else ends
    lo = (pos - window + 1).clamp_min(0) if window else torch.zeros_like(pos)
    return q, keys, values, slots, offsets, lo, hi


@pytest.mark.parametrize("heads,kv_heads,head_dim,window,causal", [
    (9, 3, 64, None, True), (4, 4, 16, None, True), (8, 2, 128, None, True), (12, 3, 32, 40, True),
    (6, 3, 64, None, False), (16, 1, 48, None, True),
])
def test_the_attention_kernel_is_softmax_attention_over_each_tokens_own_positions(heads, kv_heads, head_dim, window,
                                                                                  causal):
    args = _attention_batch([1, 7, 30, 2], [100, 9, 0, 160], heads, kv_heads, head_dim, window, causal)
    work = cpu_kernels.attention_work(int(args[-1].max()))
    got = cpu_kernels.attention(*args, scale=head_dim**-0.5, work=work)
    want = _attention_reference(*args, head_dim**-0.5)
    assert got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 4 * BF16_STEP * want.abs().max().item()


def test_an_attention_row_gets_the_same_bits_alone_in_a_batch_and_in_prefill_pieces():
    heads, kv_heads, D = 9, 3, 64
    q, keys, values, slots, offsets, lo, hi = _attention_batch([1, 8, 33, 3], [70, 20, 0, 200], heads, kv_heads, D)
    work = cpu_kernels.attention_work(256)
    batched = cpu_kernels.attention(q, keys, values, slots, offsets, lo, hi, D**-0.5, work)
    for r in range(4):  # each request alone, and each of its tokens alone
        a, b = int(offsets[r]), int(offsets[r + 1])
        alone = cpu_kernels.attention(q[a:b], keys, values, slots[r:r + 1], torch.tensor([0, b - a]), lo[a:b],
                                      hi[a:b], D**-0.5, work)
        assert torch.equal(alone, batched[a:b])
        for t in range(a, b):
            one = cpu_kernels.attention(q[t:t + 1], keys, values, slots[r:r + 1], torch.tensor([0, 1]), lo[t:t + 1],
                                        hi[t:t + 1], D**-0.5, work)
            assert torch.equal(one, batched[t:t + 1])
    # the 33-token prompt cut into pieces of 5, 16 and 12 tokens, each piece with the other requests
    a = int(offsets[2])
    for cut in ([0, 5], [5, 21], [21, 33]):
        t0, t1 = a + cut[0], a + cut[1]
        sel = torch.cat([torch.arange(0, 9), torch.arange(t0, t1)])
        piece = cpu_kernels.attention(q[sel], keys, values, slots[[0, 1, 2]], torch.tensor([0, 1, 9, 9 + t1 - t0]),
                                      lo[sel], hi[sel], D**-0.5, work)
        assert torch.equal(piece[9:], batched[t0:t1])


def _kernel_tiny():
    target = _decoding_tiny(head_dim=16)
    decoder = target.model.model
    assert decoder.use_cpu_kernels() and decoder.attention_kernel
    return target


def test_the_decoder_with_the_attention_kernel_computes_what_sdpa_computes():
    target = _kernel_tiny()
    decoder = target.model.model
    ids = torch.randint(0, 96, (3 * 20,), generator=torch.Generator().manual_seed(0))
    out = {}
    for on in (False, True):
        decoder.attention_kernel = on
        caches = [target.new_cache(64) for _ in range(3)]
        prefill = target.forward(ids, [20] * 3, caches, logits_for="all")
        step = target.forward(ids[:5], [1, 3, 1], caches, logits_for="all")
        out[on] = (prefill.logits, step.logits)
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.02)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_with_the_attention_kernel_a_prompt_in_pieces_among_other_requests_leaves_the_cache_of_a_whole_prompt():
    target = _kernel_tiny()
    prompt = torch.randint(0, 96, (41,), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2))
    whole = target.new_cache(64)
    ref = target.forward(prompt, [41], [whole], logits_for="all").logits
    pieces, busy = target.new_cache(64), target.new_cache(64)
    target.forward(other[:20], [20], [busy], logits_for="none")
    got = []
    for a, b in ([0, 3], [3, 20], [20, 41]):  # each piece in one pass with another request's decode step
        out = target.forward(torch.cat([other[20 + a % 7 : 21 + a % 7], prompt[a:b]]), [1, b - a], [busy, pieces],
                             logits_for="all").logits
        got.append(out[1:])
    assert torch.equal(torch.cat(got), ref)
    assert torch.equal(pieces.keys[:, :, :41], whole.keys[:, :, :41])
    target.model.model.batch_invariant = True
    assert target.batch_invariance_holds(rows=8, prompt_len=12)


def test_the_attention_kernel_leaves_heads_it_cannot_take_to_sdpa(monkeypatch):
    assert not _decoding_tiny().model.model.attention_kernel  # head dim 8: not a multiple of 16
    monkeypatch.setenv("DSPARK_ATTENTION_KERNEL", "0")
    target = _decoding_tiny(head_dim=16)
    assert target.model.model.use_cpu_kernels() and not target.model.model.attention_kernel


def test_prompt_pieces_go_to_sdpa_on_cpus_with_amx_and_to_the_kernel_elsewhere(monkeypatch):
    monkeypatch.delenv("DSPARK_PROMPT_ATTENTION", raising=False)
    for amx in (True, False):
        monkeypatch.setattr(cpu_kernels, "has_amx", lambda amx=amx: amx)
        assert cpu_kernels.prompts_to_kernel() is not amx
        monkeypatch.setenv("DSPARK_PROMPT_ATTENTION", "kernel")
        assert cpu_kernels.prompts_to_kernel()
        monkeypatch.setenv("DSPARK_PROMPT_ATTENTION", "sdpa")
        assert not cpu_kernels.prompts_to_kernel()
        monkeypatch.delenv("DSPARK_PROMPT_ATTENTION")
    monkeypatch.setenv("DSPARK_PROMPT_ATTENTION", "flash")
    with pytest.raises(DSparkError, match="DSPARK_PROMPT_ATTENTION='flash': expected one of auto, kernel, sdpa"):
        _kernel_tiny()  # refused when the model is loaded for decoding, before any prompt


@pytest.mark.parametrize("route", ["sdpa", "kernel"])
def test_prompt_pieces_take_one_path_however_cut_and_decoding_rows_the_kernel(monkeypatch, route):
    """``prompt_from`` names the prompt pieces of a pass: their rows take torch's fused attention
    (``DSPARK_PROMPT_ATTENTION=sdpa``, the default on CPUs with AMX) or join the decoding rows' C call (``kernel``,
    the default elsewhere): one path however the prompt is cut; the decoding rows get the bits they get alone."""
    monkeypatch.setenv("DSPARK_PROMPT_ATTENTION", route)
    target = _kernel_tiny()
    kernel_rows = []
    attention = cpu_kernels.attention
    monkeypatch.setattr(cpu_kernels, "attention", lambda q, *a: kernel_rows.append(q.shape[0]) or attention(q, *a))
    prompt = torch.randint(0, 96, (41,), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2))
    whole = target.new_cache(64)
    ref = target.forward(prompt, [41], [whole], logits_for="all", prompt_from=0).logits
    layers = len(target.model.model.layers)
    assert kernel_rows == ([] if route == "sdpa" else [41] * layers)  # a prompt alone: one path or the other
    pieces, busy, alone = target.new_cache(64), target.new_cache(64), target.new_cache(64)
    target.forward(other[:20], [20], [busy], logits_for="none", prompt_from=0)
    target.forward(other[:20], [20], [alone], logits_for="none", prompt_from=0)
    got = []
    for a, b in ([0, 3], [3, 20], [20, 41]):  # each piece in one pass with another request's decode step
        token = other[20 + a % 7 : 21 + a % 7]
        kernel_rows.clear()
        out = target.forward(torch.cat([token, prompt[a:b]]), [1, b - a], [busy, pieces], logits_for="all",
                             prompt_from=1).logits
        # the decoding row alone in the kernel's call, or with the piece: one call per layer either way
        assert kernel_rows == [1 if route == "sdpa" else 1 + b - a] * layers
        solo = target.forward(token, [1], [alone], logits_for="all").logits
        assert torch.equal(out[:1], solo)
        got.append(out[1:])
    assert torch.equal(torch.cat(got), ref)
    assert torch.equal(pieces.keys[:, :, :41], whole.keys[:, :, :41])
