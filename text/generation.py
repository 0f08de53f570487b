"""KV-cached sampling from a decoder: the one generation loop of the GPT (`text.gpt`) and the Llama-style
decoders (`text.llama`), as Hugging Face's `GenerationMixin` and nanochat's `Engine` are theirs.

A decoder it samples from is a module with `context` (the positions it sees), `new_cache(batch)` (an empty
`core.nn.transformer.KVCache`), `forward(tokens, cache=...)` (logits of tokens after the cached ones, which
it caches) and `decode(tokens, cache, direct=...)` (the same for one token per row, in eval mode; `direct`
calls the layers' `forward`s, skipping `Module.__call__`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from core.compile import torch_internals
from core.errors import ConfigError
from text.sampling import check_sampling, next_token


def _check_window(model: nn.Module, prompt: torch.Tensor, overflow_keep: int | None) -> int:
    """The tokens kept when the window is full (`overflow_keep`, default half the context); one-line
    ConfigError for a keep outside 1..context or an empty prompt."""
    keep = max(1, model.context // 2) if overflow_keep is None else overflow_keep
    if not 1 <= keep <= model.context:
        raise ConfigError(
            f"overflow_keep={keep} must be from 1 to the model's context, {model.context}",
            key="overflow_keep",
            value=str(keep),
            valid=(f">= 1 and <= {model.context}",),
        )
    if prompt.numel() == 0:
        raise ConfigError(
            "generation needs at least one prompt token (a document start)",
            key="prompt",
            value="",
            valid=(">= 1 token",),
        )
    return keep


@torch.inference_mode()  # not no_grad: no version counters or view tracking (BENCHMARKS.md § Generation)
def stream(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    overflow_keep: int | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Sample up to `max_new_tokens` from `model` after `prompt` (1-D ids), yielding each new id; stops at
    `eos_id`.

    Sampling is `text.sampling.next_token`'s (temperature 0: greedy). The prompt is prefilled in one pass,
    then each step feeds one token against the KV cache. The model sees at most `context` tokens: a longer
    prompt starts from its last `context`, and once the window is full the model goes on from the last
    `overflow_keep` tokens (default half the context), recomputing their keys and values: learned absolute
    positions make every cached key stale once the window moves (rotary ones restart from 0 alike).
    `overflow_keep=context` recomputes the whole window at each step past the context (the full forward's
    cost, and its exact output); `use_cache=False` runs a full forward per token over the same windows: the
    same tokens, no cache.
    """
    check_sampling(temperature, top_k, top_p)
    keep = _check_window(model, prompt, overflow_keep)
    ids = prompt.view(-1).tolist()
    start = max(0, len(ids) - model.context)  # the first token the model sees
    cache = model.new_cache() if use_cache else None
    # Module.__call__'s Python is a measurable share of a decoding step at the LM recipe's size
    # (BENCHMARKS.md § Generation); where no layer has a hook or a compiled call, calling the forwards
    # directly computes the same
    direct = all(torch_internals.runs_only_forward(m) for m in model.modules())
    for _ in range(max_new_tokens):
        if len(ids) - start > model.context:
            start = len(ids) - keep
            if cache is not None:
                cache.reset()
        new = ids[start + (0 if cache is None else cache.length) :]  # what the cache lacks, or all
        if cache is not None and len(new) == 1 and not model.training:
            logits = model.decode(prompt.new_tensor([new]), cache, direct=direct)[0, -1]
        else:
            logits = model(prompt.new_tensor([new]), cache=cache)[0, -1]
        nxt = next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if nxt == eos_id:
            return
        ids.append(nxt)
        yield nxt


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **options: Any) -> torch.Tensor:
    """The new ids (1-D) `stream` yields from `model` for `prompt` (1-D ids), with its keyword `options`.

    The same `generator` seed gives the same text on the same device: sampling draws from it alone.
    """
    return prompt.new_tensor(list(stream(model, prompt, max_new_tokens, **options)), dtype=torch.long)


@torch.inference_mode()
def greedy_rows(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The greedy new ids of each of `prompts`, all of one length, decoded as one batch against one KV
    cache: each row's as `stream` gives it alone (temperature 0), where prompt and new ids fit the context.
    A row ends at `eos_id` (not kept) or once `stop(its new ids)` holds (kept, as `stream`'s caller sees it).

    Rows of one length only: the decoders' cache holds no padding, so a batch of mixed lengths would need a
    key-padding mask through it."""
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache = model.new_cache(len(prompts))
    device = next(model.parameters()).device
    logits = model(torch.tensor(prompts, device=device), cache=cache)[:, -1]
    for step in range(max_new_tokens):
        picked = logits.argmax(dim=-1)
        for i, token in enumerate(picked.tolist()):
            if not done[i]:
                done[i] = token == eos_id
                new[i] += [] if done[i] else [token]
                done[i] = done[i] or (stop is not None and stop(new[i]))
        if all(done) or step == max_new_tokens - 1:
            break
        logits = model.decode(picked[:, None], cache)[:, -1]
    return new
