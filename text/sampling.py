"""The next token from a language model's logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

import torch

from core.errors import ConfigError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """One-line ConfigError for a setting `next_token` cannot use."""
    if not temperature >= 0:  # written so that NaN fails too
        raise ConfigError(
            f"temperature={temperature} must be >= 0 (0 picks the most likely token)",
            key="temperature",
            value=str(temperature),
            valid=(">= 0",),
        )
    if top_k is not None and top_k < 0:
        raise ConfigError(
            f"top_k={top_k} must be >= 0 (0 keeps every token)",
            key="top_k",
            value=str(top_k),
            valid=(">= 0",),
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(
            f"top_p={top_p} must be in (0, 1] (1 keeps every token)",
            key="top_p",
            value=str(top_p),
            valid=("> 0 and <= 1",),
        )


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """A token id from `logits` (V,): the argmax at temperature 0, else a draw from softmax(logits / T)
    limited to the `top_k` likeliest tokens, then to the fewest likeliest whose mass reaches `top_p`.

    The draw uses `generator` alone (on the CPU), so a seed gives the same tokens on every device.
    """
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    probs = filtered_probs(logits / temperature, top_k=top_k, top_p=top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def filtered_probs(
    logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """softmax(`logits`) over the last dimension (each row of a batch alone), limited to the `top_k`
    likeliest tokens, then to the fewest likeliest whose mass reaches `top_p`; the rest are 0."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        ranked, order = probs.sort(dim=-1, descending=True)
        above = ranked.cumsum(-1) - ranked  # the mass of the tokens ranked above each one
        # a token stays while the likelier ones have not reached top_p, so the likeliest always stays
        ranked = ranked.masked_fill(above >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
    return probs
