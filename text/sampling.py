"""The next token from a language model's logits: greedy, or sampled with temperature, top-k, top-p and
min-p; either with a repetition penalty on the tokens already in the sequence (Hugging Face's logits
processors' semantics, checked against them in tests)."""

from __future__ import annotations

import torch

from core.errors import ConfigError


def check_sampling(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
) -> None:
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
    if min_p is not None and not 0 <= min_p <= 1:
        raise ConfigError(
            f"min_p={min_p} must be in [0, 1] (0 keeps every token)",
            key="min_p",
            value=str(min_p),
            valid=(">= 0 and <= 1",),
        )
    if not repetition_penalty > 0:
        raise ConfigError(
            f"repetition_penalty={repetition_penalty} must be > 0 (1: none; above 1 discourages repeats)",
            key="repetition_penalty",
            value=str(repetition_penalty),
            valid=("> 0",),
        )


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`logits` (..., V) with each token of `seen` (bool, the same shape) made less likely by `penalty`
    (CTRL's repetition penalty, as Hugging Face applies it: a positive logit divided by it, a negative one
    multiplied); `logits` itself where the penalty is 1."""
    if penalty == 1.0:
        return logits
    lowered = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, lowered, logits)


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """A token id from `logits` (V,): the argmax at temperature 0, else a draw from softmax(logits / T)
    limited to the `top_k` likeliest tokens, then to the fewest likeliest whose mass reaches `top_p`, then
    to those at least `min_p` times as likely as the likeliest; the tokens of `seen` (bool (V,): the
    sequence so far) penalised by `repetition_penalty` first (`penalize_repeats`), greedy or not.

    The draw uses `generator` alone (on the CPU), so a seed gives the same tokens on every device.
    """
    logits = logits.float()
    if seen is not None:
        logits = penalize_repeats(logits, seen, repetition_penalty)
    if temperature == 0:
        return int(logits.argmax())
    probs = filtered_probs(logits / temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def filtered_probs(
    logits: torch.Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """softmax(`logits`) over the last dimension (each row of a batch alone), limited to the `top_k`
    likeliest tokens, then to the fewest likeliest whose mass reaches `top_p`, then to those at least
    `min_p` times as likely as the likeliest (min-p sampling); the rest are 0, the kept ones not
    renormalised (a draw from them is the same)."""
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
    if min_p:  # the likeliest token always stays
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs
