"""Context features appended in place (dspark.generation.context_features) against torch.cat."""

import torch

from dspark.drafters.base import RequestState
from dspark.generation.context_features import FeatureBuffer, append_context_features
from dspark.sampling.processing import SamplingParams

F = 6


def _request(prompt_len: int = 5, max_new: int = 4) -> RequestState:
    return RequestState("r", prompt_len, list(range(1, prompt_len + 1)), SamplingParams(0.0, max_new_tokens=max_new),
                        torch.Generator())


def _pieces(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, F, generator=g) for n in sizes]


def test_appends_equal_concatenation_and_write_into_one_buffer():
    req = _request()
    pieces = _pieces([4, 2, 1, 2])  # prompt 5 + 4 new tokens: all a request can commit
    append_context_features(req, pieces[0])
    ptr = req.context_features.data_ptr()
    for piece in pieces[1:]:
        append_context_features(req, piece)
    assert torch.equal(req.context_features, torch.cat(pieces))
    assert req.context_features.data_ptr() == ptr  # no copy: every append wrote into the first buffer
    assert req.feature_buffer.capacity >= 5 + 4


def test_growing_past_the_room_keeps_every_row():
    req = _request(prompt_len=2, max_new=1)
    pieces = _pieces([2, 3, 5, 9], seed=1)
    for piece in pieces:
        append_context_features(req, piece)
    assert torch.equal(req.context_features, torch.cat(pieces))
    assert req.feature_buffer.capacity >= 19


def test_a_rewound_view_is_appended_after_and_later_rows_overwritten():
    req = _request()
    a, b, c = _pieces([4, 3, 2], seed=2)
    append_context_features(req, a)
    snapshot = req.context_features  # what a profiler keeps before a step
    append_context_features(req, b)
    req.context_features = snapshot  # the step undone
    append_context_features(req, c)
    assert torch.equal(req.context_features, torch.cat([a, c]))
    assert torch.equal(snapshot, a)  # the kept view still reads the rows it had


def test_features_set_by_hand_are_copied_not_aliased():
    req = _request()
    a, b, c = _pieces([4, 3, 2], seed=3)
    append_context_features(req, a)
    outside = b.clone()
    req.context_features = outside  # not a view of the request's buffer
    append_context_features(req, c)
    assert torch.equal(req.context_features, torch.cat([b, c]))
    assert torch.equal(outside, b)


def test_a_new_dtype_starts_a_new_buffer():
    req = _request()
    a, b = _pieces([3, 2], seed=4)
    append_context_features(req, a)
    append_context_features(req, b.to(torch.bfloat16))
    assert req.context_features.dtype == torch.bfloat16
    assert torch.equal(req.context_features, torch.cat([a, b]).to(torch.bfloat16))


def test_holds_only_prefix_views():
    buf = FeatureBuffer(torch.zeros(8, F), length=5)
    assert buf.holds(buf.data[:3])
    assert not buf.holds(buf.data[1:4])  # not from row 0
    assert not buf.holds(buf.data[:6])  # past the filled rows
    assert not buf.holds(buf.data[:3].clone())
