"""Chunked prefill: prompts fed in pieces give the same outputs, and decode steps run between the pieces."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import RequestState
from dspark.generation.generator import SpeculativeGenerator
from dspark.generation.step import prefill
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineConfig
from tests.drafters.tiny_drafters import LAYER_IDS
from tests.tiny import tiny_target

# prompts longer than several chunks of 8, one shorter than a chunk
PROMPTS = [[(7 * i + 3) % 90 + 2 for i in range(70)], [(5 * i) % 80 + 10 for i in range(33)], [4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def test_prefill_in_pieces_equals_one_piece(target):
    prompt = PROMPTS[0]

    def run(pieces):
        req = RequestState("r", len(prompt), list(prompt), SamplingParams(0.0), torch.Generator())
        cache = target.new_cache(len(prompt) + 4)
        done = [prefill(target, [req], [cache], LAYER_IDS, [n])[0] for n in pieces]
        return req, cache, done

    whole, whole_cache, _ = run([len(prompt)])
    chunked, cache, done = run([8] * 8 + [6])
    assert done == [False] * 8 + [True]
    assert chunked.tokens == whole.tokens and len(chunked.tokens) == len(prompt) + 1  # the same first token
    assert cache.length == whole_cache.length == len(prompt)
    torch.testing.assert_close(cache.keys[:, :, : len(prompt)], whole_cache.keys[:, :, : len(prompt)])
    # the drafter's context features cover every prompt position, equal to one-piece prefill
    assert chunked.context_features.shape == whole.context_features.shape == (len(prompt), len(LAYER_IDS) * 32)
    torch.testing.assert_close(chunked.context_features, whole.context_features)


def test_chunked_prefill_keeps_greedy_outputs_and_dspark_drafts(target):
    """DSpark reads the target's context features: with pieces of 8 they must be complete, so every
    request's drafts and confidence logits, and the (greedy) outputs, equal those of whole-prompt prefill."""
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from tests.drafters.tiny_drafters import tiny_dspark

    drafter = DSparkDrafter(tiny_dspark(target))
    propose = drafter.propose
    sampling = SamplingParams(0.0, max_new_tokens=24)
    expected = [SpeculativeGenerator(target).generate([p], sampling)[0].output_ids for p in PROMPTS]
    runs, drafts = {}, {}

    def recording(requests, max_tokens):
        block = propose(requests, max_tokens)
        for r, req in enumerate(requests):
            n = int(block.num_tokens[r])  # 0 when only other requests of the batch have room to draft
            if n:
                drafts[req.request_id].append((block.tokens[r, :n], block.confidence_logits[r, :n]))
        return block

    drafter.propose = recording
    for chunk in (8, None):
        drafts = {f"p{i}": [] for i in range(len(PROMPTS))}
        with Engine(target, drafter, None, EngineConfig(max_batch=3, prefill_chunk=chunk)) as engine:
            handles = [engine.submit(p, sampling, request_id=f"p{i}") for i, p in enumerate(PROMPTS)]
            runs[chunk] = ([h.result(30)[0] for h in handles], drafts)
            assert engine.stats().prompt_tokens == sum(map(len, PROMPTS))
    assert runs[8][0] == runs[None][0] == expected
    for rid, steps in runs[8][1].items():
        assert len(steps) == len(runs[None][1][rid]) > 1
        for (tokens, conf), (tokens_whole, conf_whole) in zip(steps, runs[None][1][rid]):
            assert tokens.tolist() == tokens_whole.tolist()
            torch.testing.assert_close(conf, conf_whole)


class _Recorder:
    """Wraps target.forward: records each call as ("prefill" | "decode", tokens)."""

    def __init__(self, target) -> None:
        self.calls: list[tuple[str, int]] = []
        self._forward = target.forward
        target.forward = self

    def __call__(self, input_ids, seq_lens, caches, capture_layers=None, logits_for="all", prompt_from=None):
        self.calls.append(("prefill" if logits_for == "last" else "decode", sum(seq_lens)))
        return self._forward(input_ids, seq_lens, caches, capture_layers, logits_for, prompt_from)


@pytest.mark.parametrize("chunk", [16, None])
def test_decode_steps_run_between_prefill_chunks(chunk):
    """A short request decodes while a 100-token prompt is prefilled: between two of its steps the target
    sees at most one chunk. Negative control (chunk None): the whole prompt in one call."""
    target = tiny_target(seed=0)
    target.eos_token_ids = []  # the short request runs its full length
    short, long = [3, 4, 5, 6, 7], [(3 * i) % 90 + 2 for i in range(100)]
    expected = SpeculativeGenerator(target).generate([long], SamplingParams(0.0, max_new_tokens=3))[0].output_ids
    recorder = _Recorder(target)
    engine = Engine(target, None, None, EngineConfig(max_batch=2, prefill_chunk=chunk, mix_prefill=False)).start()
    engine.pause()  # both are admitted together: the short prompt and the long one's first piece
    a = engine.submit(short, SamplingParams(0.0, max_new_tokens=60))
    b = engine.submit(long, SamplingParams(0.0, max_new_tokens=3))
    engine.resume()
    out_b = b.result(30)[0]
    a.result(30)
    engine.stop()
    prefills = [n for kind, n in recorder.calls if kind == "prefill"]
    assert sum(prefills) == len(short) + len(long)
    assert out_b == expected
    kinds = [kind for kind, _ in recorder.calls]
    last_prefill = len(kinds) - 1 - kinds[::-1].index("prefill")
    if chunk is None:
        assert prefills == [len(short) + len(long)]
        return
    assert max(prefills) <= chunk and len(prefills) == -(-(len(short) + len(long)) // chunk)
    # prefill, decode, prefill, decode, ...: never two pieces of prompt back to back
    assert kinds[: last_prefill + 1] == ["prefill", "decode"] * (len(prefills) - 1) + ["prefill"]


def test_batch_invariant_prompts_are_cut_at_their_own_offsets_one_per_pass():
    """batch_invariant: each prefill pass holds one prompt's piece, cut at multiples of the chunk from its start,
    so a prompt's passes are the same whatever else waits; the texts are those of separate generation."""
    target = tiny_target(seed=0)
    prompts = [[(5 * i + k) % 90 + 2 for i in range(n)] for k, n in enumerate([37, 5, 50])]
    expected = [SpeculativeGenerator(target).generate([p], SamplingParams(0.0, max_new_tokens=4))[0].output_ids
                for p in prompts]
    recorder = _Recorder(target)
    engine = Engine(target, None, None, EngineConfig(max_batch=3, prefill_chunk=16, batch_invariant=True)).start()
    engine.pause()  # all three admitted together: a mixed-budget engine would share passes between them
    handles = [engine.submit(p, SamplingParams(0.0, max_new_tokens=4)) for p in prompts]
    engine.resume()
    assert [h.result(30)[0] for h in handles] == expected
    engine.stop()
    prefills = [n for kind, n in recorder.calls if kind == "prefill"]
    assert prefills == [16, 16, 5, 5, 16, 16, 16, 2]  # 37 = 16+16+5, 5, 50 = 16+16+16+2: one prompt per pass
    assert all(kind != "mixed" for kind, _ in recorder.calls)
