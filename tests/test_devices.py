"""Devices, dtypes and optional dependencies.

On every machine: ``--device`` / ``--dtype`` resolution, ``--device cuda`` without a GPU (exit 2, one line), the
checkpoint dtype, the extras' one-line errors. Tests marked ``cuda`` need a GPU (tests/conftest.py skips them
elsewhere; scripts/gpu_check.sh runs them): the target, its caches and every drafter on the GPU, SDPA attention
there, and greedy speculative output equal to plain greedy output for every drafter.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from dspark.cli import build_parser, main
from dspark.cli_options import load_target_from_args, resolve_target_args
from dspark.target.loading import default_dtype_name, resolve_device
from dspark.errors import DSparkError
from dspark.extras import EXTRAS, MissingExtraError, require
from tests.tiny import save_hf_folder, tiny_config, tiny_target

REPO = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")

# every command that loads a model, with the least it needs to get as far as loading it
MODEL_COMMANDS = {
    "generate": ["generate", "--drafter", "none", "--prompt", "hi"],
    "eval": ["eval", "--drafter", "none", "--datasets", "gsm8k", "--limit", "1"],
    "calibrate": ["calibrate", "--drafter", "none", "--datasets", "gsm8k", "--limit", "1"],
    "profile": ["profile"],
    "serve": ["serve"],
    "demo": ["demo"],
    "bench speed": ["bench", "speed"],
    "bench serve": ["bench", "serve"],
    "bench chaos": ["bench", "chaos"],
    "bench train": ["bench", "train"],
    "data regenerate": ["data", "regenerate", "--prompts", "p.jsonl", "--out", "o.jsonl"],
    "data features": ["data", "features", "--data", "tok", "--out", "cache"],
    "train": ["train", "--config", "smollm2-dspark-markov"],
}


# ---------------------------------------------------------------- --device and --dtype

@no_gpu
@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the repository
    argv = MODEL_COMMANDS[command] + ["--device", "cuda"]
    if command == "train":
        argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dspark: error:") and "cuda" in err[0], err
    assert "--device cpu" in err[0] or "device=cpu" in err[0]  # says what to do


@pytest.mark.parametrize("command", [c for c in MODEL_COMMANDS if c != "train"])
def test_every_model_command_takes_device_auto_by_default(command):
    args = build_parser().parse_args(MODEL_COMMANDS[command])
    assert args.device == "auto"
    assert getattr(args, "dtype", None) is None  # resolved per device when the target is loaded


def test_train_device_and_save_dtype_flags_set_the_config(capsys):
    assert main(["train", "--config", "smollm2-dspark-markov", "--print-config"]) == 0
    import json

    default = json.loads(capsys.readouterr().out)
    assert default["save_dtype"] == "bfloat16" and default["device"] == "cpu"  # the preset's device
    assert main(["train", "--config", "smollm2-dspark-markov", "--device", "auto", "--save-dtype", "float32",
                 "--print-config"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["device"] == "auto" and chosen["save_dtype"] == "float32"


def test_a_bad_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--prompt", "hi", "--device", "tpu"])
    assert exit_info.value.code == 2
    with pytest.raises(DSparkError, match="expected one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_auto_is_cuda_when_a_gpu_is_available_and_the_dtype_follows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device(None) == "cuda"
    args = argparse.Namespace(device="auto", dtype=None)
    assert resolve_target_args(args) == ("cuda", "bfloat16") and (args.device, args.dtype) == ("cuda", "bfloat16")
    assert resolve_target_args(argparse.Namespace(device="cuda", dtype="float32")) == ("cuda", "float32")
    assert resolve_target_args(argparse.Namespace(device="cpu", dtype=None)) == ("cpu", "float32")


def test_auto_is_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_target_args(argparse.Namespace(device="auto", dtype=None)) == ("cpu", "float32")
    assert resolve_target_args(argparse.Namespace(device="auto", dtype="bfloat16")) == ("cpu", "bfloat16")
    assert (default_dtype_name("cpu"), default_dtype_name("cuda")) == ("float32", "bfloat16")
    with pytest.raises(DSparkError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_load_target_from_args_loads_on_the_resolved_device_and_dtype(tmp_path):
    folder = save_hf_folder(tmp_path / "t", tiny_config())
    args = argparse.Namespace(target=str(folder), device="cpu", dtype=None, compile=False)
    target = load_target_from_args(args, tokenizer=False)
    assert (target.device.type, target.dtype, args.dtype) == ("cpu", torch.float32, "float32")
    assert target.new_cache(8).keys.device == target.device


# ---------------------------------------------------------------- attention path

def _attention_calls(target, monkeypatch, tokens: int) -> int:
    """How often one forward pass of ``tokens`` tokens calls SDPA."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.arange(3, 3 + tokens, device=target.device)
    target.forward(ids, [tokens], [target.new_cache(32)])
    return len(calls)


def test_cpu_attends_block_wise_without_sdpa(monkeypatch):
    """On the CPU every row, prefill or verify, is attended block by block for load independence: SDPA, which
    rounds long and short pieces differently, is not called. The reference per-request loop still calls it for
    prefill (negative control: the counter sees SDPA where it runs). See
    docs/architecture.md §Making a step cheap"""
    target = tiny_target()
    assert _attention_calls(target, monkeypatch, 20) == 0  # prefill
    assert _attention_calls(target, monkeypatch, 4) == 0  # verify block
    target.model.model.attention = "per-request"
    assert _attention_calls(target, monkeypatch, 20) == target.num_layers


# ---------------------------------------------------------------- checkpoints

def test_checkpoints_are_bf16_by_default_and_float32_on_request(tmp_path):
    from safetensors import safe_open

    from dspark.drafters.registry import kind_entry
    from dspark.training.trainer import train
    from tests.training.test_trainer import random_data, tiny_cfg

    target = tiny_target()
    dtypes = {}
    for save_dtype in (None, "float32"):
        out = tmp_path / str(save_dtype)
        kw = {"max_steps": 1, "checkpoint_every": 1} | ({"save_dtype": save_dtype} if save_dtype else {})
        last = train(tiny_cfg(out, **kw), target=target, dataset=random_data(2))
        with safe_open(str(last / "model.safetensors"), "pt") as f:
            dtypes[save_dtype] = {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()}
        loaded = kind_entry("dspark").model_class.from_checkpoint(last, target)  # loaders read either
        assert loaded.fc.weight.dtype == torch.float32
    assert dtypes == {None: {torch.bfloat16}, "float32": {torch.float32}}


# ---------------------------------------------------------------- optional dependencies

def test_a_missing_extra_is_one_line_naming_it():
    with pytest.raises(MissingExtraError) as err:
        require("surely_not_installed_module", "plots", "drawing figures")
    message = str(err.value)
    assert "\n" not in message and "pip install 'dspark[plots]'" in message and "surely_not_installed_module" in message
    assert isinstance(err.value, DSparkError) and isinstance(err.value, ImportError)
    assert require("json", "plots", "x").__name__ == "json"  # present: just the module


def test_figures_without_matplotlib_name_the_plots_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.delitem(sys.modules, "dspark.evaluation.plots", raising=False)
    with pytest.raises(MissingExtraError, match=r"dspark\[plots\]"):
        import dspark.evaluation.plots  # noqa: F401
    from dspark.evaluation.report import plot_ablation

    with pytest.raises(MissingExtraError, match=r"dspark\[plots\]"):
        plot_ablation([], "x.png", "depth", "t")


def test_converting_a_gguf_preset_without_gguf_names_the_gguf_extra(monkeypatch, tmp_path):
    from dspark.target.convert import convert_gguf_preset
    from dspark.target.presets import PRESETS

    monkeypatch.setitem(sys.modules, "gguf", None)
    preset = next(iter(PRESETS.values()))
    with pytest.raises(MissingExtraError, match=r"pip install 'dspark\[gguf\]'"):
        convert_gguf_preset(preset, tmp_path / "new")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "config.json").write_text("{}")
    assert convert_gguf_preset(preset, tmp_path / "done") == tmp_path / "done"  # converted once: gguf not needed


def test_pyproject_extras_match_what_the_code_asks_for_and_make_installs_them():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for name in ("matplotlib", "tensorboard", "gguf", "accelerate"):
        assert name not in core
    assert set(EXTRAS) <= set(extras)
    assert extras["all"] == [f"dspark[{','.join(EXTRAS)}]"]
    assert any(d.startswith("matplotlib") for d in extras["plots"])
    assert any(d.startswith("gguf") for d in extras["gguf"])
    assert any(d.startswith("tensorboard") for d in extras["tensorboard"])
    assert 'pip install -q -e ".[all,test,data]"' in (REPO / "Makefile").read_text()  # make demo / make test


# ---------------------------------------------------------------- on a GPU

PROMPTS = [[5, 9, 13, 5, 9, 22, 5, 9], [7, 7, 8, 20, 31, 44, 7, 7, 8]]


def _cuda_target(seed: int = 1):
    target = tiny_target(seed=seed)
    target.model.to("cuda")
    return target


def _drafters(target):
    """Every drafter kind on ``target``'s device: (name, drafter, was it overfitted to accept drafts)."""
    from dspark.drafters.draft_lm.drafter import DraftModelDrafter
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from dspark.drafters.eagle3.drafter import Eagle3Drafter
    from dspark.drafters.hybrid import HybridDrafter
    from dspark.drafters.prompt_lookup import PromptLookupDrafter
    from tests.drafters.tiny_drafters import overfit_on_greedy, tiny_dflash, tiny_dspark, tiny_eagle3

    other = tiny_target(seed=3).model.to("cuda")
    dspark, eagle3 = tiny_dspark(target), tiny_eagle3(target)
    overfit_on_greedy(target, dspark, PROMPTS[0])
    overfit_on_greedy(target, eagle3, PROMPTS[0])
    return [
        ("prompt-lookup", PromptLookupDrafter(target.vocab_size, 5)),
        ("draft-lm", DraftModelDrafter(other, target.vocab_size, 3)),
        ("draft-lm=target", DraftModelDrafter(target.model, target.vocab_size, 4)),
        ("dspark", DSparkDrafter(dspark)),
        ("dspark-rnn", DSparkDrafter(tiny_dspark(target, markov_head_type="rnn"))),
        ("dspark-top-m", DSparkDrafter(dspark, head_top_m=8)),
        ("dflash", DSparkDrafter(tiny_dflash(target))),
        ("eagle3", Eagle3Drafter(eagle3)),
        ("hybrid", HybridDrafter(DSparkDrafter(dspark), target.vocab_size, min_ngram=2, max_ngram=4)),
    ]


@pytest.mark.cuda
def test_cuda_greedy_equals_plain_greedy_for_every_drafter():
    from dspark.drafters.base import NoDrafter
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    target = _cuda_target()
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    plain = [r.output_ids for r in SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate(PROMPTS, sp)]
    accepted = {}
    for name, drafter in _drafters(target):
        model = getattr(drafter, "model", None)
        if isinstance(model, torch.nn.Module):
            assert next(model.parameters()).is_cuda, name
        out = SpeculativeGenerator(target, drafter).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == plain, name
        accepted[name] = sum(r.stats.num_accepted for r in out)
    assert accepted["draft-lm=target"] > 0 and accepted["dspark"] > 0 and accepted["eagle3"] > 0  # accept path ran


@pytest.mark.cuda
def test_cuda_sampling_runs_with_host_generators():
    """Per-request generators live on the CPU; their uniforms join GPU probabilities (sample_from_probs)."""
    from dspark.drafters.prompt_lookup import PromptLookupDrafter
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    target = _cuda_target()
    gen = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 4))
    sp = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=s) for s in (1, 2)]
    a, b = gen.generate(PROMPTS, sp), gen.generate(PROMPTS, sp)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]  # a seed reproduces on the GPU too


@pytest.mark.cuda
def test_cuda_decode_steps_use_sdpa(monkeypatch):
    target = _cuda_target()
    assert _attention_calls(target, monkeypatch, 4) == target.num_layers
    assert _attention_calls(target, monkeypatch, 1) == target.num_layers


@pytest.mark.cuda
def test_cuda_target_defaults_to_bf16_and_checkpoint_drafters_follow_it(tmp_path):
    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter
    from tests.drafters.tiny_drafters import tiny_dspark, tiny_eagle3

    folder = save_hf_folder(tmp_path / "t", tiny_config())
    args = argparse.Namespace(target=str(folder), device="auto", dtype=None, compile=False)
    target = load_target_from_args(args, tokenizer=False)
    assert (target.device.type, target.dtype, args.dtype) == ("cuda", torch.bfloat16, "bfloat16")
    cache = target.new_cache(8)
    assert cache.keys.is_cuda and cache.keys.dtype == torch.bfloat16
    cpu_target = load_target_from_args(argparse.Namespace(target=str(folder), device="cpu", dtype=None,
                                                          compile=False), tokenizer=False)
    tiny_dspark(cpu_target, target_layer_ids=[0, 1]).save_checkpoint(tmp_path / "dspark")
    tiny_eagle3(cpu_target, target_layer_ids=[0, 1]).save_checkpoint(tmp_path / "eagle3")
    for kind in ("dspark", "eagle3"):
        drafter = load_drafter(str(tmp_path / kind), target, DraftingOptions())
        weight = next(drafter.model.parameters())
        assert weight.is_cuda and weight.dtype == torch.bfloat16, kind


# ---------------------------------------------------------------- --threads

@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_the_global_threads_flag_reaches_every_model_command(command):
    """`dspark --threads 1 COMMAND`: a command's own --threads must not reset the global value to None (argparse
    lets a subparser's default overwrite it), or the command runs on torch's default thread count unnoticed."""
    parsed = build_parser().parse_args(["--threads", "1", *MODEL_COMMANDS[command]])
    assert parsed.threads == 1
    if command in ("profile", "serve", "bench serve", "bench speed"):  # their own flag still works
        assert build_parser().parse_args([*MODEL_COMMANDS[command], "--threads", "3"]).threads == 3
