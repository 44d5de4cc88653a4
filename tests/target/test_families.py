"""Our decoder equals Hugging Face transformers for every family we claim.

Each case is a tiny random config saved as an HF folder by transformers' own
class, with every parameter (norm weights and biases included) perturbed so
that nothing sits at its initial value. We load it with ``load_target`` and
compare against the HF model (eager attention, float32):
logits, the raw output of every decoder layer (``capture_layers``), the
final-normed state, incremental decoding through our KV cache, and a flattened
batch of requests of different lengths.

Shapes: T = tokens of one sequence, V = vocabulary, H = hidden size.
"""

from __future__ import annotations

import pytest
import torch

from dspark.modeling.spec import spec_from_config
from dspark.target.model import TargetModel, load_target
from tests.tiny import save_hf_folder

TOL = 1e-4  # max abs difference, float32
SEQ = 12  # test sequence length; every sliding window below is smaller

_BASE = {
    "vocab_size": 128, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}

CASES: dict[str, dict] = {
    "llama": {**_BASE, "model_type": "llama"},
    # Llama 3.1 RoPE scaling with a short original context so that all three frequency bands occur
    # (wavelengths 6, 29, 135, ... against high/low bounds 8 and 32); biases everywhere; tied head.
    "llama3-rope-bias-tied": {
        **_BASE, "model_type": "llama", "num_hidden_layers": 2, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    },
    "llama-linear-rope": {
        **_BASE, "model_type": "llama", "num_hidden_layers": 2,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    },
    "mistral": {**_BASE, "model_type": "mistral", "sliding_window": 5},
    "qwen2": {**_BASE, "model_type": "qwen2", "tie_word_embeddings": True},
    # Qwen2 with the sliding window on layers >= max_window_layers only
    "qwen2-sliding": {**_BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
                      "max_window_layers": 1},
    "qwen3": {**_BASE, "model_type": "qwen3", "head_dim": 16, "rope_parameters": {"rope_theta": 1e6}},
    "qwen3-bias": {**_BASE, "model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 8, "attention_bias": True},
    "gemma": {**_BASE, "model_type": "gemma", "head_dim": 16, "num_key_value_heads": 1},
    # small soft-caps so that tanh is far from linear on these scores and logits
    "gemma2": {**_BASE, "model_type": "gemma2", "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 4,
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {
        **_BASE, "model_type": "gemma3_text", "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 4,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    },
}


def _perturb_and_resave(folder, std: float = 0.2, seed: int = 0):
    """Load the folder with transformers, move every parameter off its init value, save it again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(case name, HF model, our TargetModel) for one case."""
    name = request.param
    folder = save_hf_folder(tmp_path_factory.mktemp(name), CASES[name])
    hf = _perturb_and_resave(folder)
    ours = load_target(str(folder), tokenizer=False)
    return name, hf, ours


def _ids(n: int, seed: int) -> torch.Tensor:  # (n,)
    return torch.randint(3, _BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _hf_forward(hf, ids: torch.Tensor):
    """HF logits (T, V), hidden_states tuple of (T, H), and the raw output of every decoder layer."""
    raw: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, i, o: raw.append((o[0] if isinstance(o, tuple) else o)[0]))
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            out = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0], [h[0] for h in out.hidden_states], raw


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_sliding_window_is_exercised(pair):
    """Our per-layer windows are HF's, and the window cases have windows shorter than SEQ."""
    name, hf, ours = pair
    windows = [ours.spec.window_for(i) for i in range(ours.num_layers)]
    # Qwen/Gemma attention modules store their window; Mistral applies config.sliding_window to every layer
    hf_windows = [getattr(layer.self_attn, "sliding_window", getattr(hf.config, "sliding_window", None))
                  for layer in hf.model.layers]
    assert windows == hf_windows
    if name.startswith(("mistral", "gemma2", "gemma3", "qwen2-sliding")):
        assert any(w is not None and w < SEQ for w in windows)
    else:
        assert windows == [None] * ours.num_layers


def test_logits_and_hidden_states_match_hf(pair):
    name, hf, ours = pair
    ids = _ids(SEQ, seed=1)
    hf_logits, hf_hidden, hf_raw = _hf_forward(hf, ids)
    layers = list(range(ours.num_layers))
    out = ours.forward(ids, [SEQ], None, capture_layers=layers)
    assert _maxdiff(out.logits, hf_logits) < TOL, name
    H = ours.hidden_size
    for layer in layers:
        feat = out.features[:, layer * H : (layer + 1) * H]  # (T, H)
        assert _maxdiff(feat, hf_raw[layer]) < TOL, (name, layer)
        if layer < ours.num_layers - 1:  # HF's last entry is the final-normed state instead
            assert _maxdiff(feat, hf_hidden[layer + 1]) < TOL, (name, layer)
    assert _maxdiff(out.last_hidden, hf_hidden[-1]) < TOL, name
    # capture order follows the ids given, and "last" returns the final position only
    out2 = ours.forward(ids, [SEQ], None, capture_layers=[layers[-1], 0], logits_for="last")
    assert torch.equal(out2.features[:, :H], out.features[:, -H:])
    assert _maxdiff(out2.logits, hf_logits[-1:]) < TOL


def test_incremental_decoding_matches_full_forward(pair):
    """Prefill 5, then 4 tokens at once, then 3 one at a time == one full forward (HF)."""
    name, hf, ours = pair
    ids = _ids(SEQ, seed=2)
    hf_logits, _, _ = _hf_forward(hf, ids)
    cache = ours.new_cache(capacity=4)  # smaller than the sequence: growth is part of the test
    chunks = [5, 4, 1, 1, 1]
    got, start = [], 0
    for n in chunks:
        got.append(ours.forward(ids[start : start + n], [n], [cache]).logits)
        start += n
    assert cache.length == SEQ
    assert _maxdiff(torch.cat(got), hf_logits) < TOL, name


def test_flattened_batch_equals_each_request_alone(pair):
    """3 requests of different lengths in one flattened forward, without and with caches."""
    name, hf, ours = pair
    lens = [7, SEQ, 3]
    seqs = [_ids(n, seed=10 + r) for r, n in enumerate(lens)]
    alone = [_hf_forward(hf, s)[0] for s in seqs]  # (n_r, V) each
    out = ours.forward(torch.cat(seqs), lens, None)
    for r, got in enumerate(out.logits.split(lens)):
        assert _maxdiff(got, alone[r]) < TOL, (name, r)
    # a verify-like step: each request has its own cache length and appends a different count
    caches = [ours.new_cache(capacity=8) for _ in lens]
    prefill, step = [4, 9, 1], [3, 3, 2]
    first = ours.forward(torch.cat([s[:p] for s, p in zip(seqs, prefill)]), prefill, caches)
    second = ours.forward(torch.cat([s[p : p + k] for s, p, k in zip(seqs, prefill, step)]), step, caches)
    for r, (a, b) in enumerate(zip(first.logits.split(prefill), second.logits.split(step))):
        want = alone[r][: prefill[r] + step[r]]
        assert _maxdiff(torch.cat([a, b]), want) < TOL, (name, r)
        assert caches[r].length == prefill[r] + step[r]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_minimal_config_gets_hf_defaults(model_type):
    """A config.json with only the sizes gives the spec HF would build (family defaults match)."""
    from transformers import AutoConfig

    # 32 heads: the families' default KV-head counts (4, 8, 16, 32) must divide it
    minimal = {"model_type": model_type, "vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 8,
               "num_attention_heads": 32, "intermediate_size": 128}
    filled = AutoConfig.for_model(**minimal).to_dict()
    assert spec_from_config(minimal) == spec_from_config(filled)


def test_wrong_model_is_detected(pair):
    """Negative control: a different seed's weights do not pass the same bar."""
    name, hf, ours = pair
    other = type(ours.model)(ours.spec)
    torch.manual_seed(123)
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = _ids(SEQ, seed=1)
    wrong = TargetModel(other, None, "other", None, [1], ours.max_context).forward(ids, [SEQ], None).logits
    assert _maxdiff(wrong, _hf_forward(hf, ids)[0]) > 100 * TOL


@pytest.mark.cuda
def test_matches_hf_on_cuda(pair):
    """Same comparison with everything on the GPU: positions, masks and caches follow the model's device."""
    name, hf, ours = pair
    hf_gpu = hf.to("cuda")
    ours.model.to("cuda")
    try:
        ids = _ids(SEQ, seed=4).cuda()
        with torch.no_grad():
            want = hf_gpu(input_ids=ids[None], use_cache=False).logits[0]  # (T, V)
        assert _maxdiff(ours.forward(ids, [SEQ], None).logits, want) < TOL, name
        cache = ours.new_cache(capacity=4)
        assert cache.keys.is_cuda
        got = [ours.forward(ids[a:b], [b - a], [cache], logits_for="last").logits for a, b in
               [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12)]]  # (1, V) each
        assert _maxdiff(torch.cat(got), want[[4, 8, 9, 10, 11]]) < TOL, name
    finally:
        hf.to("cpu")
        ours.model.to("cpu")
