"""The one confidence adapter: confidence logits + STS temperatures -> confidences -> verify lengths."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import DraftBlock
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import AsyncTopKScheduler, FixedLength, PolicyError, StaticThreshold
from dspark.scheduler.sps import SPSTable


def block(logits: list[list[float]] | None, num_tokens: list[int], dtype=torch.float32) -> DraftBlock:
    R, K = len(num_tokens), max(num_tokens)
    conf = None if logits is None else torch.tensor(logits, dtype=dtype)
    return DraftBlock(torch.zeros(R, K, dtype=torch.long), torch.tensor(num_tokens), torch.zeros(R, K, 5), conf)


class Spy:
    """A policy that records what it was given and verifies one draft per request."""

    def __init__(self, requires_confidences: bool) -> None:
        self.requires_confidences = requires_confidences
        self.seen: list[torch.Tensor | None] = []

    def choose(self, confidences, num_candidates):
        self.seen.append(confidences)
        return num_candidates.clamp(max=1)


def test_confidences_are_float64_whatever_the_logits_dtype():
    logits = [[0.5, -1.0], [2.0, 0.25]]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        conf = ConfidenceAdapter(sts_temperatures=[2.0, 0.5]).confidences(block(logits, [2, 2], dtype))
        assert conf.dtype == torch.float64
        expected = torch.sigmoid(torch.tensor(logits, dtype=dtype).double() / torch.tensor([2.0, 0.5]))
        assert torch.equal(conf, expected)


def test_the_policy_gets_confidences_only_when_it_reads_them():
    b = block([[3.0, -3.0], [0.0, 0.0]], [2, 1])
    reads, ignores = Spy(True), Spy(False)
    assert ConfidenceAdapter(reads).verify_len(b).tolist() == [1, 1]
    assert torch.equal(reads.seen[0], torch.sigmoid(b.confidence_logits.double()))
    ConfidenceAdapter(ignores).verify_len(b)
    assert ignores.seen == [None]


def test_one_fallback_rule_for_drafters_without_a_confidence_head():
    no_head = block(None, [3, 1])
    assert ConfidenceAdapter(StaticThreshold(0.9)).verify_len(no_head).tolist() == [3, 1]  # default c = 1.0
    assert ConfidenceAdapter(StaticThreshold(0.9), fallback_confidence=0.5).verify_len(no_head).tolist() == [0, 0]
    assert ConfidenceAdapter(FixedLength(2), fallback_confidence=None).verify_len(no_head).tolist() == [2, 1]
    with pytest.raises(PolicyError, match="confidence head"):
        ConfidenceAdapter(StaticThreshold(0.5), fallback_confidence=None).verify_len(no_head)


def test_bad_settings_are_policy_errors():
    with pytest.raises(PolicyError, match="fallback"):
        ConfidenceAdapter(fallback_confidence=-0.1)
    with pytest.raises(PolicyError, match="> 0"):
        ConfidenceAdapter(sts_temperatures=[1.0, 0.0])
    with pytest.raises(PolicyError, match="refit STS"):
        ConfidenceAdapter(StaticThreshold(0.5), sts_temperatures=[1.0]).verify_len(block([[1.0, 1.0]], [2]))


def test_verify_all_and_empty_blocks_do_not_call_the_policy():
    assert ConfidenceAdapter().verify_len(block([[1.0, -9.0]], [2])).tolist() == [2]
    policy = AsyncTopKScheduler(SPSTable.flat(), lag=1)
    empty = DraftBlock(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(2, 0, 5))
    assert ConfidenceAdapter(policy).verify_len(empty).tolist() == [0, 0]
    assert policy.capacity(2) is None  # no step recorded in its history


def test_of_wraps_a_bare_policy_once():
    adapter = ConfidenceAdapter(StaticThreshold(0.5), sts_temperatures=[2.0])
    assert ConfidenceAdapter.of(adapter) is adapter
    wrapped = ConfidenceAdapter.of(FixedLength(1))
    assert wrapped.policy == FixedLength(1) and wrapped.sts_temperatures is None and wrapped.name == "FixedLength"
    assert ConfidenceAdapter.of(None).name == "all"
