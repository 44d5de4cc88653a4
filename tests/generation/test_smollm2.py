"""The real default target: speculative greedy equals plain greedy; the CLI prints statistics."""

import json

import pytest

from dspark.cli import main
from dspark.drafters.base import NoDrafter
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def test_prompt_lookup_equals_plain_greedy_on_smollm2(smollm2):
    prompts = [smollm2.encode_chat(c) for c in CHATS]
    sp = SamplingParams(temperature=0.0, max_new_tokens=48)
    ref = SpeculativeGenerator(smollm2, NoDrafter(smollm2.vocab_size)).generate(prompts, sp)
    for block in (3, 7):
        out = SpeculativeGenerator(smollm2, PromptLookupDrafter(smollm2.vocab_size, block)).generate(prompts, sp)
        assert [r.output_ids for r in out] == [r.output_ids for r in ref]


def test_generate_cli_matches_plain_and_reports(capsys, smollm2):
    rc = main(["generate", "--drafter", "prompt-lookup", "--chat", CHATS[0], "--max-new-tokens", "40",
               "--compare-plain", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches_plain_greedy"] is True
    assert report["new_tokens"] == 40
    assert report["acceptance_length"] >= 1.0
    assert len(report["per_position_acceptance"]) == 7


def test_generate_cli_bad_input(capsys, smollm2, tmp_path):
    assert main(["generate", "--chat", "   "]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--chat", "hi", "--drafter", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    long_prompt = "word " * 9000
    assert main(["generate", "--prompt", long_prompt]) == 2
    assert "context" in capsys.readouterr().err
