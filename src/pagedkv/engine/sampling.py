"""Engine adapter: sampling parameters and next-token sampling (greedy, temperature, top-p).

Each random request draws from its own seeded `torch.Generator`, so its tokens do not depend
on which other requests share the batch, nor on preemption (a recomputed prefix draws nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's output tokens.

    `temperature == 0` is greedy (argmax; `top_p` and `seed` unused). Otherwise tokens are
    drawn from `softmax(logits / temperature)` restricted to the smallest set of tokens whose
    probability reaches `top_p`. (Stop tokens are the scheduler's: `EngineConfig.stop_token_ids`.)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(
                f"max_tokens must be a positive int, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0.0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per logits row; row i follows `params[i]` (and `generators[i]` if random)."""
    # Hot path: the common all-greedy batch is one argmax and one host transfer.
    greedy = logits.argmax(dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.is_greedy:
            continue
        greedy[row] = _sample_row(logits[row], row_params, generator)
    return greedy


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # Keep a token if the mass strictly before it is below top_p (the first is always kept).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(sorted_ids[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
