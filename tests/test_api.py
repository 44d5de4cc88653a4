"""The Python API (``dspark.load`` / ``dspark.train``, src/dspark/api.py) on a tiny random target behind SmolLM2's
tokenizer: the CLI's loading defaults, lossless greedy text through generate, chat, stream and the engine,
seeded sampling, user errors, and training from a dict or a TrainConfig."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import dspark
from dspark.cli_options import load_target_from_args
from dspark.errors import DSparkError, ModelLoadError, PromptError
from tests.tiny import save_chat_target

TINY_DSPARK = {"block_size": 4, "num_anchors": 8, "markov_rank": 16}
PROMPTS = ["w1 w2 w3 w1 w2 w3 w1 w2", "the the the the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_chat_target(tmp_path_factory.mktemp("tiny-chat"))[0]


@pytest.fixture(scope="module")
def plain(folder):
    return dspark.load(str(folder))


@pytest.fixture(scope="module")
def lookup(folder):
    return dspark.load(str(folder), drafter="prompt-lookup")


def test_import_dspark_loads_no_torch_and_resolves_names_on_use():
    code = ("import sys, dspark; assert 'torch' not in sys.modules, 'torch at import'; "
            "from dspark.api import load; assert dspark.load is load; print(sorted(dspark.__all__))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {"load", "train", "Completion", "SamplingParams", "Engine"} <= set(eval(proc.stdout))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dspark.nope  # noqa: B018


def test_load_reads_the_target_as_the_cli_does(folder, monkeypatch):
    from dspark.cli import build_parser
    from dspark.target import model

    calls = []
    real = model.load_target
    monkeypatch.setattr(model, "load_target", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    sd = dspark.load(str(folder))
    load_target_from_args(build_parser().parse_args(["generate", "--target", str(folder), "--chat", "hi"]))
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0][1]["fuse"] and calls[0][1]["batch_invariant"] and calls[0][1]["pack"]
    assert str(sd.target.dtype) == "torch.float32" and sd.target.device.type == "cpu" and sd.drafter_name == "none"


def test_generate_chat_and_stream_are_lossless(plain, lookup):
    drafted = lookup.generate(PROMPTS, max_new_tokens=24)
    reference = plain.generate(PROMPTS, max_new_tokens=24)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in reference]
    assert [o.text for o in drafted] == [o.text for o in reference]
    assert all(o.acceptance_length >= 1.0 and o.finish_reason in ("stop", "length") for o in drafted)
    assert max(o.acceptance_length for o in drafted) > 1.0  # the repeated prompts do accept drafts
    assert plain.generate(PROMPTS[0], max_new_tokens=8)[0].token_ids == reference[0].token_ids[:8]  # one = a batch of one

    answer = lookup.chat("w5 w6 w5 w6 w5", max_new_tokens=20)
    assert answer.token_ids == plain.chat([{"role": "user", "content": "w5 w6 w5 w6 w5"}], max_new_tokens=20).token_ids
    stream = lookup.stream_chat("w5 w6 w5 w6 w5", max_new_tokens=20)
    assert "".join(stream) == answer.text and stream.completion.token_ids == answer.token_ids
    raw = lookup.stream(PROMPTS[1], max_new_tokens=24)
    assert "".join(raw) == reference[1].text and raw.completion.stats.num_steps >= 1


def test_seeded_sampling_reproduces_and_seeds_differ(lookup):
    a = lookup.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=3)
    b = lookup.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=3)
    c = lookup.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=4)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]  # negative control: the seed is used


def test_engine_gives_the_generate_text(lookup, plain):
    ids = lookup.encode_chat("w7 w8 w7 w8")
    with lookup.engine(policy="fixed:2", max_batch=2) as engine:
        out = engine.generate(ids, dspark.SamplingParams(temperature=0.0, max_new_tokens=16), timeout=120)
    assert out == plain.chat("w7 w8 w7 w8", max_new_tokens=16).token_ids


def test_user_errors_are_clear(folder, plain):
    with pytest.raises(PromptError, match="role"):
        plain.chat([{"content": "no role"}])
    with pytest.raises(PromptError, match="empty"):
        plain.chat("   ")
    with pytest.raises(DSparkError, match="temperature"):
        plain.generate("w1", temperature=-1.0)
    with pytest.raises(ModelLoadError, match="no such folder"):
        dspark.load(str(folder), drafter="no/such/drafter")
    with pytest.raises(DSparkError, match="float16"):
        dspark.load(str(folder), dtype="float16")
    with pytest.raises(DSparkError, match="head_top_m"):
        dspark.load(str(folder), drafter="prompt-lookup", head_top_m=-1)
    assert plain.generate([], max_new_tokens=4) == []


@pytest.fixture(scope="module")
def tokenized(folder, plain, tmp_path_factory):
    from dspark.data.tokenized import write_tokenized

    work = tmp_path_factory.mktemp("data")
    rows = [{"conversations": [{"role": "user", "content": p}, {"role": "assistant", "content": p + " " + p}]}
            for p in PROMPTS * 3]
    (work / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tokenized(work / "conv.jsonl", plain.tokenizer, work / "tok", max_length=64, min_loss_tokens=1, progress=False)
    return work / "tok"


def test_train_from_a_dict_and_a_config_then_decode_with_the_checkpoint(folder, plain, tokenized, tmp_path):
    config = dict(drafter="dspark", target=str(folder), data=[str(tokenized)], out=str(tmp_path / "a"),
                  model=TINY_DSPARK, grad_accum=1, feature_source="online", num_threads=1, log_every=1)
    last = dspark.train(config, max_steps=2)
    assert last == tmp_path / "a" / "step_2"
    again = dspark.train(dspark.TrainConfig(**config), overrides=["max_steps=1", "model.block_size=3"],
                         out=str(tmp_path / "b"))
    saved = json.loads((again / "train_config.json").read_text())
    assert again == tmp_path / "b" / "step_1" and saved["model"]["block_size"] == 3
    mine = dspark.load(str(folder), drafter=str(last))
    assert mine.drafter.block_size == 4
    assert [o.token_ids for o in mine.generate(PROMPTS, max_new_tokens=12)] == \
        [o.token_ids for o in plain.generate(PROMPTS, max_new_tokens=12)]
    with pytest.raises(DSparkError, match="unknown training config key"):
        dspark.train({**config, "learning_rate": 1.0})
