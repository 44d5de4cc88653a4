"""`dspark export --to sglang|vllm|vocab`: the written folder is exactly what each engine's loader reads.

Every export is passed through the simulated loaders of ``engine_loaders.py`` (restated from SGLang's and
vLLM's source): no tensor may be ignored, no engine parameter left unfilled, the config must resolve to the
drafter's block size, target layers, mask token and heads. What an engine cannot load is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.cli import main
from dspark.drafters.checkpoint import read_checkpoint_state
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.draft_vocab import save_draft_vocab
from dspark.drafters.dspark.vocab import prune_to_draft_vocab
from dspark.errors import DSparkError, IncompatibleModelsError
from dspark.export.engines import export_for_engine, plan_export
from tests.drafters.tiny_drafters import LAYER_IDS, random_tokens, sample_for, tiny_dflash, tiny_dspark, tiny_eagle3
from tests.tiny import tiny_target

from . import engine_loaders as engines


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target(model_type="qwen3", architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def llama():
    return tiny_target()


def _ckpt(model, folder):
    model.save_checkpoint(folder)
    return folder


def _same_weights(loaded: engines.Loaded, ckpt, prefix: str = "") -> None:
    """Every engine parameter holds the checkpoint's tensor (bf16), q/k/v and gate/up stacked in order."""
    ours = read_checkpoint_state(ckpt)
    for name, t in loaded.params.items():
        assert t.dtype in (torch.bfloat16, torch.int64), name
        key = name.removeprefix(prefix)
        if ".qkv_proj." in key:
            ref = torch.cat([ours[key.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
        elif ".gate_up_proj." in key:
            ref = torch.cat([ours[key.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")])
        elif key in ours:
            ref = ours[key]
        else:
            continue
        assert torch.equal(t, ref.to(torch.bfloat16)), name


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_for_sglang_is_read_field_by_field(qwen3, tmp_path, head):
    model = tiny_dspark(qwen3, markov_head_type=head)
    ckpt = _ckpt(model, tmp_path / "ckpt")
    plan, command = export_for_engine(ckpt, "sglang", tmp_path / "out", target="Qwen/Qwen3-8B")
    loaded = engines.sglang_dspark(tmp_path / "out", qwen3.vocab_size, verify_mode="compact")
    assert (loaded.ignored, loaded.unfilled) == ([], [])
    assert loaded.arch == "Qwen3DSparkModel" and loaded.gamma == model.config.block_size
    assert loaded.capture_after == LAYER_IDS and loaded.mask_token_id == model.config.mask_token_id
    assert (loaded.markov_rank, loaded.head_type, loaded.confidence) == (model.config.markov_rank, head, True)
    _same_weights(loaded, ckpt)
    assert f"--speculative-num-draft-tokens {model.config.block_size + 1}" in command
    assert "--speculative-algorithm DSPARK" in command and "--speculative-draft-model-path" in command


def test_dspark_for_vllm_is_read_field_by_field(qwen3, tmp_path):
    model = tiny_dspark(qwen3)
    ckpt = _ckpt(model, tmp_path / "ckpt")
    _, command = export_for_engine(ckpt, "vllm", tmp_path / "out", target="Qwen/Qwen3-8B")
    loaded = engines.vllm_dspark(tmp_path / "out", qwen3.vocab_size)
    assert loaded.unfilled == [] and loaded.capture_after == LAYER_IDS
    assert loaded.mask_token_id == model.config.mask_token_id and loaded.confidence
    _same_weights(loaded, ckpt, prefix="model.")
    spec = json.loads(command.split("--speculative-config ")[1].strip("'"))
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == model.config.block_size
    assert spec["enable_adaptive_verification"] is True


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_vllm_refuses_heads_other_than_vanilla(qwen3, tmp_path, head):
    ckpt = _ckpt(tiny_dspark(qwen3, markov_head_type=head), tmp_path / "ckpt")
    with pytest.raises(IncompatibleModelsError, match="vanilla only"):
        plan_export(ckpt, "vllm")


def test_llama_target_dspark_with_llama_layers_is_refused_by_both(llama, tmp_path):
    ckpt = _ckpt(tiny_dspark(llama, draft_layer="target"), tmp_path / "ckpt")
    for engine, version in (("sglang", "SGLang 0.5.23"), ("vllm", "vLLM 0.32.0")):
        with pytest.raises(IncompatibleModelsError, match="Qwen3-shaped") as err:
            plan_export(ckpt, engine)
        msg = str(err.value)  # one line: the field, what the engine builds, the version read
        assert "\n" not in msg and "draft_layer 'target'" in msg and version in msg and "draft_layer=qwen3" in msg


@pytest.mark.parametrize("target", ["llama", "gemma2"])
def test_qwen3_layer_dspark_of_any_target_exports_to_both(target, tmp_path):
    tiny = tiny_target(**({} if target == "llama" else {"model_type": "gemma2", "final_logit_softcapping": 30.0}))
    model = tiny_dspark(tiny, draft_layer="qwen3")
    ckpt = _ckpt(model, tmp_path / "ckpt")
    export_for_engine(ckpt, "sglang", tmp_path / "sglang")
    export_for_engine(ckpt, "vllm", tmp_path / "vllm")
    loaded = engines.sglang_dspark(tmp_path / "sglang", tiny.vocab_size, verify_mode="compact")
    assert (loaded.ignored, loaded.unfilled) == ([], []) and loaded.capture_after == LAYER_IDS
    _same_weights(loaded, ckpt)
    assert engines.vllm_dspark(tmp_path / "vllm", tiny.vocab_size).unfilled == []


@pytest.mark.parametrize("vocab", [None, [5, 1, 9, 40, 2, 77, 3, 60]])
def test_anchor_plus_k_dflash_goes_to_vllm_as_dflash_draft_model(llama, tmp_path, vocab):
    """slot_offset 1 + Qwen3 layers: vLLM's DFlashDraftModel with dflash_config; K = block_size - 1 drafts."""
    model = tiny_dflash(llama, slot_offset=1, draft_layer="qwen3", block_size=5)
    ckpt, folder = _ckpt(model, tmp_path / "ckpt"), None
    if vocab is not None:
        ckpt = prune_to_draft_vocab(ckpt, vocab, tmp_path / "pruned", target=llama)
        folder = tmp_path / "target"  # the LM head rows come from the target's folder
        folder.mkdir()
        save_file({"lm_head.weight": llama.model.lm_head.weight.detach()}, str(folder / "model.safetensors"))
    plan, command = export_for_engine(ckpt, "vllm", tmp_path / "out", target="HuggingFaceTB/SmolLM2-135M-Instruct",
                                      target_folder=folder)
    loaded = engines.vllm_dflash(tmp_path / "out", llama.vocab_size)
    assert (loaded.arch, loaded.unfilled) == ("DFlashDraftModel", [])
    assert loaded.capture_after == LAYER_IDS and loaded.mask_token_id == model.config.mask_token_id
    assert loaded.draft_vocab_size == (llama.vocab_size if vocab is None else len(vocab))
    if vocab is not None:
        d2t = loaded.params["draft_id_to_target_id"]
        assert (torch.arange(len(vocab)) + d2t).tolist() == vocab
    _same_weights(loaded, ckpt, prefix="model.")
    spec = json.loads(command.split("--speculative-config ")[1].strip("'"))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4
    assert command.startswith("python -m vllm.entrypoints.openai.api_server --model HuggingFaceTB/")


def test_anchor_plus_k_refusals_name_the_field_the_convention_and_the_version(llama, tmp_path):
    dflash = _ckpt(tiny_dflash(llama, slot_offset=1, draft_layer="qwen3"), tmp_path / "dflash")
    with pytest.raises(IncompatibleModelsError, match=r"slot_offset 1.*anchor \+ k.*anchor \+ k \+ 1") as err:
        plan_export(dflash, "sglang")
    assert "SGLang 0.5.23" in str(err.value)
    markov = _ckpt(tiny_dspark(llama, slot_offset=1, draft_layer="qwen3"), tmp_path / "markov")
    with pytest.raises(IncompatibleModelsError, match="slot_offset 1 with a Markov") as err:
        plan_export(markov, "vllm")
    assert "vLLM 0.32.0" in str(err.value)
    llama_layers = _ckpt(tiny_dflash(llama, slot_offset=1, draft_layer="target"), tmp_path / "llama")
    with pytest.raises(IncompatibleModelsError, match="draft_layer 'target'.*DFlashDraftModel"):
        plan_export(llama_layers, "vllm")
    with pytest.raises(engines.Refused, match="dflash is not detected"):  # the negative control of the loader
        export_for_engine(_ckpt(tiny_dflash(llama, draft_layer="qwen3"), tmp_path / "s0"), "vllm", tmp_path / "o")
        engines.vllm_dflash(tmp_path / "o", llama.vocab_size)


def test_dflash_becomes_dspark_with_a_zero_head_that_drafts_the_same(qwen3, tmp_path):
    """Both engines' DSpark need markov_rank > 0 and their DFlash reads anchor + k: a rank-1 zero head is exact."""
    model = tiny_dflash(qwen3)
    model.save_checkpoint(tmp_path / "ckpt", torch.bfloat16)
    for engine in ("sglang", "vllm"):
        plan, _ = export_for_engine(tmp_path / "ckpt", engine, tmp_path / engine)
        assert any("zero rank-1" in n for n in plan.notes)
    loaded = engines.sglang_dspark(tmp_path / "sglang", qwen3.vocab_size)  # static: no confidence head needed
    assert (loaded.markov_rank, loaded.ignored, loaded.unfilled) == (1, [], [])
    assert engines.vllm_dspark(tmp_path / "vllm", qwen3.vocab_size).unfilled == []
    with pytest.raises(engines.Refused, match="confidence"):  # SGLang's ragged modes need a trained head
        engines.sglang_dspark(tmp_path / "sglang", qwen3.vocab_size, verify_mode="compact")
    # our own loader reads the export back: the same draft distributions as the bf16 DFlash checkpoint
    a = DSparkModel.from_checkpoint(tmp_path / "ckpt", qwen3)
    a.copy_frozen_from(qwen3)  # the engines share the target's embedding and LM head, unrounded
    b = DSparkModel.from_checkpoint(tmp_path / "sglang", qwen3)
    sample = sample_for(qwen3, random_tokens(14, seed=4), LAYER_IDS)
    anchors = torch.tensor([2, 7])
    assert torch.allclose(a.block_logits(sample, anchors), b.block_logits(sample, anchors), atol=1e-5)


def test_draft_vocabulary_goes_to_vllm_as_d2t(qwen3, tmp_path):
    """(SGLang: test_sglang_draft_vocab.py, a masking Markov rank over the full vocabulary.)"""
    full = _ckpt(tiny_dspark(qwen3), tmp_path / "full")
    ids = torch.randperm(qwen3.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    small = prune_to_draft_vocab(full, ids, tmp_path / "small", torch.float32)
    with pytest.raises(IncompatibleModelsError, match="--target-folder"):  # the LM head is left out of it
        plan_export(small, "vllm")
    head = torch.randn(qwen3.vocab_size, qwen3.hidden_size)
    (tmp_path / "target").mkdir()
    save_file({"lm_head.weight": head}, str(tmp_path / "target" / "model.safetensors"))
    export_for_engine(small, "vllm", tmp_path / "out", target_folder=tmp_path / "target")
    loaded = engines.vllm_dspark(tmp_path / "out", qwen3.vocab_size)
    assert loaded.unfilled == [] and loaded.draft_vocab_size == 40
    d2t = loaded.params["draft_id_to_target_id"]
    assert torch.equal(torch.arange(40) + d2t, ids)
    assert torch.equal(loaded.params["lm_head.weight"], head[ids].to(torch.bfloat16))  # vLLM's mapping: target id = draft id + d2t[draft id]
    w1 = loaded.params["model.markov_head.markov_w1.weight"]  # (V, r) indexed by target ids
    src = load_file(str(small / "model.safetensors"))["markov_head.markov_w1.weight"]
    assert torch.equal(w1[ids], src.to(torch.bfloat16))
    outside = torch.ones(qwen3.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert not w1[outside].any()  # a previous token outside the draft vocabulary: zero embedding, as trained


def test_eagle3_with_three_layers_for_both_engines(llama, tmp_path):
    ckpt = _ckpt(tiny_eagle3(llama), tmp_path / "ckpt")
    export_for_engine(ckpt, "sglang", tmp_path / "sglang")
    loaded = engines.sglang_eagle3(tmp_path / "sglang")
    assert (loaded.ignored, loaded.unfilled) == ([], [])
    assert loaded.capture_after == LAYER_IDS
    ours = read_checkpoint_state(ckpt)
    assert torch.equal(loaded.params["model.midlayer.hidden_norm.weight"],
                       ours["layers.0.hidden_norm.weight"].to(torch.bfloat16))
    _, command = export_for_engine(ckpt, "vllm", tmp_path / "vllm")
    assert engines.vllm_eagle3_layers(tmp_path / "vllm") == LAYER_IDS
    assert '"method": "eagle3"' in command


def test_eagle3_refusals(llama, qwen3, tmp_path):
    two = _ckpt(tiny_eagle3(llama, target_layer_ids=[0, 2]), tmp_path / "two")
    with pytest.raises(IncompatibleModelsError, match="exactly 3"):
        plan_export(two, "sglang")
    qk = _ckpt(tiny_eagle3(qwen3), tmp_path / "qk")
    with pytest.raises(IncompatibleModelsError, match="Llama-shaped"):
        plan_export(qk, "vllm")


def test_anchor_plus_k_checkpoint_is_refused(qwen3, tmp_path):
    ckpt = _ckpt(tiny_dflash(qwen3), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(IncompatibleModelsError, match="anchor \\+ k"):
        plan_export(ckpt, "sglang")


def test_side_files(qwen3, tmp_path):
    model = tiny_dspark(qwen3)
    ckpt = _ckpt(model, tmp_path / "ckpt")
    G = model.config.block_size
    sps, sts = tmp_path / "sps.json", tmp_path / "sts.json"
    sps.write_text(json.dumps({"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [50.0, 40.0],
                               "max_batch_tokens": 64}))
    sts.write_text(json.dumps({"temperatures": [1.0] * G, "dataset": "x", "num_samples": 1,
                               "ece_before": [0.0] * G, "ece_after": [0.0] * G}))
    _, command = export_for_engine(ckpt, "sglang", tmp_path / "out", sps_table=sps, sts=sts)
    assert (tmp_path / "out" / "dspark_sps.json").read_text() == sps.read_text()
    assert command.startswith("SGLANG_RAGGED_VERIFY_MODE=compact ")
    assert f"--speculative-dspark-sps-table-path {tmp_path / 'out' / 'dspark_sps.json'}" in command
    assert f"--speculative-dspark-confidence-sts-path {tmp_path / 'out' / 'sts.json'}" in command
    with pytest.raises(IncompatibleModelsError, match="vLLM reads no SPS"):
        plan_export(ckpt, "vllm", sps_table=sps)
    with pytest.raises(IncompatibleModelsError, match="require an SPS table"):
        plan_export(ckpt, "sglang", sts=sts)
    sts.write_text(json.dumps({"temperatures": [1.0] * (G + 1)}))
    with pytest.raises(DSparkError):
        plan_export(ckpt, "sglang", sps_table=sps, sts=sts)
    nohead = _ckpt(tiny_dflash(qwen3), tmp_path / "nohead")
    with pytest.raises(IncompatibleModelsError, match="no confidence head"):
        plan_export(nohead, "sglang", sps_table=sps)


def test_cli_prints_the_command_or_one_line_refusal(qwen3, llama, tmp_path, capsys):
    ok = _ckpt(tiny_dspark(qwen3), tmp_path / "ok")
    assert main(["export", "--to", "vllm", str(ok), str(tmp_path / "o1"), "--target", "Qwen/Qwen3-8B"]) == 0
    assert "vllm.entrypoints.openai.api_server --model Qwen/Qwen3-8B --speculative-config" in capsys.readouterr().out
    bad = _ckpt(tiny_dspark(llama, draft_layer="target"), tmp_path / "bad")
    assert main(["export", "--to", "sglang", str(bad), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Qwen3-shaped" in err


def test_export_to_vocab_and_its_deprecated_form_write_the_same_checkpoint(qwen3, tmp_path, capsys):
    full = _ckpt(tiny_dspark(qwen3), tmp_path / "full")
    ids = torch.randperm(qwen3.vocab_size, generator=torch.Generator().manual_seed(1))[:40].tolist()
    vocab = save_draft_vocab(tmp_path / "vocab.json", ids, qwen3.vocab_size, 0.9, "test")
    assert main(["export", "--to", "vocab", str(full), str(tmp_path / "new"), "--vocab", str(vocab)]) == 0
    out = capsys.readouterr()
    assert "40-token draft vocabulary, bfloat16" in out.out and out.err == ""
    assert main(["export-vocab", "--checkpoint", str(full), "--vocab", str(vocab), "--out", str(tmp_path / "old")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deprecated" in err and "dspark export --to vocab" in err
    new, old = load_file(str(tmp_path / "new" / "model.safetensors")), load_file(str(tmp_path / "old" / "model.safetensors"))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
    assert sorted(new["draft_vocab"].tolist()) == sorted(ids)
    # flags of the other kind of export are refused in one line
    assert main(["export", "--to", "vocab", str(full), str(tmp_path / "x")]) == 2
    assert main(["export", "--to", "vllm", str(full), str(tmp_path / "y"), "--vocab", str(vocab)]) == 2
    err = capsys.readouterr().err
    assert "needs --vocab" in err and "--vocab is for --to vocab" in err
