"""Sampling: greedy rows, temperature, top-p's nucleus and per-request seeded generators."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine.sampling import SamplingParams, make_generator, sample_tokens  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

pytestmark = pytest.mark.torch


def test_top_p_draws_only_from_the_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.6 keeps tokens 0 and 1 (0.5 < 0.6 <= 0.8).
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])
    params = [SamplingParams(temperature=1.0, top_p=0.6)]
    generator = make_generator(0, torch.device("cpu"))
    drawn = [sample_tokens(logits, params, [generator])[0] for _ in range(200)]
    assert set(drawn) == {0, 1}
    everything = [SamplingParams(temperature=1.0)]
    drawn = [sample_tokens(logits, everything, [generator])[0] for _ in range(400)]
    assert set(drawn) == {0, 1, 2, 3}


def test_greedy_and_random_rows_mix_and_seeds_replay():
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    params = [SamplingParams(), SamplingParams(temperature=0.7)]
    first = [sample_tokens(logits, params, [None, make_generator(5, torch.device("cpu"))])]
    again = [sample_tokens(logits, params, [None, make_generator(5, torch.device("cpu"))])]
    assert first == again and first[0][0] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(**kwargs)
