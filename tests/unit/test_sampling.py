"""warp_logits (greedy, temperature, top-k, top-p), sample, make_generator."""

from __future__ import annotations

import math

import pytest
import torch

from specmesh.core.sampling import make_generator, sample, warp_logits
from specmesh.core.types import SamplingParams


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    """probs: V floats -> logits [1, V] float32 with softmax(logits) == probs."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def test_greedy_is_one_hot_on_argmax_with_lowest_index_ties():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-3.0, -2.0, -9.0, -2.5]])
    probs = warp_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    expected = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.float32)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)
    assert sample(probs, make_generator(0)).tolist() == [1, 0, 1]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    for temp in (0.5, 1.0, 2.0):
        probs = warp_logits(logits, SamplingParams(temperature=temp))
        torch.testing.assert_close(probs, torch.softmax(logits / temp, dim=-1))
    # higher temperature flattens: the top token's probability decreases monotonically
    tops = [warp_logits(logits, SamplingParams(temperature=t))[0, 2].item() for t in (0.5, 1, 2)]
    assert tops[0] > tops[1] > tops[2]


def test_tiny_temperature_does_not_overflow():
    logits = torch.tensor([[1e4, -1e4, 0.0]])
    probs = warp_logits(logits, SamplingParams(temperature=1e-30))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0]]))


def test_top_k_mask():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [4.0, 4.0, 4.0, 1.0, 0.0]])
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    # row 0 keeps tokens 1, 3; row 1 has a three-way tie and keeps the two lowest indices
    assert [torch.nonzero(row).flatten().tolist() for row in probs] == [[1, 3], [0, 1]]
    expected0 = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    torch.testing.assert_close(probs[0, [1, 3]], expected0)
    torch.testing.assert_close(probs[1, [0, 1]], torch.tensor([0.5, 0.5]))
    # top_k >= V is a no-op
    full = warp_logits(logits, SamplingParams(temperature=1.0, top_k=5))
    torch.testing.assert_close(full, torch.softmax(logits, dim=-1))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.01, [0]),
        (0.5, [0]),
        (0.75, [0, 1]),
        (0.85, [0, 1, 2]),
        (0.97, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_mask(top_p, kept):
    base = [0.5, 0.3, 0.15, 0.05]
    # shuffle vocab positions so the mask is checked in vocab order, not sorted order
    perm = [2, 0, 3, 1]  # base[i] lives at vocab position perm[i]
    probs_v = [0.0] * 4
    for i, p in enumerate(base):
        probs_v[perm[i]] = p
    probs = warp_logits(_logits_from_probs(probs_v), SamplingParams(temperature=1.0, top_p=top_p))
    kept_v = sorted(perm[i] for i in kept)
    assert torch.nonzero(probs[0]).flatten().tolist() == kept_v
    mass = sum(base[i] for i in kept)
    expected = torch.tensor([probs_v[j] / mass for j in kept_v])
    torch.testing.assert_close(probs[0, kept_v], expected)
    assert abs(probs.sum().item() - 1.0) < 1e-6


def test_top_k_then_top_p():
    # top_k=3 leaves [0.5, 0.3, 0.15] / 0.95; top_p=0.8 then needs 0.526 + 0.316 = 0.842 -> 2 tokens
    probs = warp_logits(_logits_from_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(1.0, 0.8, 3))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_empty_batch_and_bad_shape():
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=3)):
        probs = warp_logits(torch.zeros(0, 8), params)
        assert probs.shape == (0, 8)
        assert sample(probs, None).shape == (0,)
    with pytest.raises(ValueError):
        warp_logits(torch.zeros(8), SamplingParams())
    with pytest.raises(ValueError):
        sample(torch.ones(8), None)


def test_sampling_is_deterministic_with_seed():
    logits = torch.randn(16, 50, generator=make_generator(3))
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20)
    probs_a, probs_b = warp_logits(logits, params), warp_logits(logits, params)
    assert torch.equal(probs_a, probs_b)
    runs = [[sample(probs_a, make_generator(42)).tolist() for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]
    # different seeds diverge somewhere across 16 rows x 3 draws (V=50, flat-ish rows)
    other = [sample(probs_a, make_generator(43)).tolist() for _ in range(3)]
    assert other != runs[0]
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()
    assert make_generator(-1).initial_seed() == 2**64 - 1


def test_sample_frequencies_follow_probs():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4)
    tokens = sample(probs, make_generator(5))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert freq[1].item() == 0.0
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)


def test_sample_never_draws_a_token_of_probability_zero():
    """Zeros inside and after the mass, unnormalised rows, a 49,152-token vocabulary: 4,000 draws."""
    v = 49152
    probs = torch.zeros(4, v)
    probs[0, [3, 700, 48000]] = torch.tensor([0.5, 2.0, 1.5])  # unnormalised, trailing zeros
    probs[1, :10] = 1.0
    probs[2] = torch.rand(v, generator=make_generator(1)) * (torch.arange(v) % 3 != 0)  # every third 0
    probs[3, -1] = 1e-30  # a single tiny entry: one-hot by max == sum
    tokens = torch.stack([sample(probs, make_generator(s)) for s in range(1000)])  # [1000, 4]
    assert set(tokens[:, 0].tolist()) == {3, 700, 48000}
    assert set(tokens[:, 1].tolist()) <= set(range(10)) and len(set(tokens[:, 1].tolist())) == 10
    assert (tokens[:, 2] % 3 != 0).all() and (tokens[:, 3] == v - 1).all()


@pytest.mark.parametrize("row", [[0.5, -0.1, 0.6], [0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [float("inf"), 0.0, 1.0]])
def test_sample_rejects_rows_that_are_no_distribution(row):
    with pytest.raises(ValueError):
        sample(torch.tensor([row]), make_generator(0))
