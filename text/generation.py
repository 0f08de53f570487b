"""KV-cached sampling from a decoder, for the GPT (`text.gpt`) and the Llama-style decoders (`text.llama`),
as Hugging Face's `GenerationMixin` and nanochat's `Engine` are theirs: `stream` yields one sequence's new
ids as they come (sliding its window past the context), `sample_rows` decodes a batch of prompts of any
lengths, left-padded against one cache (a GRPO group's samples with their log-probabilities; `greedy_rows`
is it at temperature 0).

A decoder it samples from is a module with `context` (the positions it sees), `new_cache(batch)` (an empty
`core.nn.transformer.KVCache`), `forward(tokens, cache=..., logits_to_keep=...)` (logits of tokens after
the cached ones, which it caches; the last position's alone with `logits_to_keep=1`) and `decode(tokens,
cache, direct=...)` (the same for one token per row, in eval mode; `direct` calls the layers' `forward`s,
skipping `Module.__call__`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from core.compile import torch_internals
from core.errors import ConfigError
from core.nn.transformer import autocast_dtype
from text.sampling import check_sampling, filtered_probs, next_token, penalize_repeats


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
        raise _empty_prompt()
    return keep


def _empty_prompt() -> ConfigError:
    """The one-line error of a prompt of no tokens."""
    return ConfigError(
        "generation needs at least one prompt token (a document start)",
        key="prompt",
        value="",
        valid=(">= 1 token",),
    )


def without_autograd(device: torch.device) -> contextlib.AbstractContextManager:
    """What generation runs under: `inference_mode` (no version counters or view tracking), but `no_grad`
    under autocast, which keeps its casts of the weights through a call only outside inference mode:
    inside, it casts every weight again at every token (both measured: BENCHMARKS.md § Generation)."""
    return torch.no_grad() if autocast_dtype(device) is not None else torch.inference_mode()


def stream(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    overflow_keep: int | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Sample up to `max_new_tokens` from `model` after `prompt` (1-D ids), yielding each new id; stops at
    `eos_id`.

    Sampling is `text.sampling.next_token`'s (temperature 0: greedy; `repetition_penalty` on every token of
    the prompt and of the new ids, in the window or not, as Hugging Face's). The prompt is prefilled in one
    pass, then each step feeds one token against the KV cache. The model sees at most `context` tokens: a
    longer prompt starts from its last `context`, and once the window is full the model goes on from the last
    `overflow_keep` tokens (default half the context), recomputing their keys and values: learned absolute
    positions make every cached key stale once the window moves (rotary ones restart from 0 alike).
    `overflow_keep=context` recomputes the whole window at each step past the context (the full forward's
    cost, and its exact output); `use_cache=False` runs a full forward per token over the same windows: the
    same tokens, no cache.
    """
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    keep = _check_window(model, prompt, overflow_keep)
    options = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    options["repetition_penalty"] = repetition_penalty
    steps = _stream(model, prompt, max_new_tokens, keep, options, eos_id, generator, use_cache)
    while True:  # each step under the grad mode, not the caller's code between them
        with without_autograd(prompt.device):
            nxt = next(steps, None)
        if nxt is None:
            return
        yield nxt


def _stream(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    keep: int,
    options: dict[str, Any],
    eos_id: int | None,
    generator: torch.Generator | None,
    use_cache: bool,
) -> Iterator[int]:
    """`stream`'s decoding, its arguments checked (`options`: `next_token`'s sampling keywords)."""
    ids = prompt.view(-1).tolist()
    penalized = options["repetition_penalty"] != 1.0
    seen = None  # (V,): the tokens the repetition penalty lowers, every one of the sequence so far
    start = max(0, len(ids) - model.context)  # the first token the model sees
    cache = model.new_cache() if use_cache else None
    direct = _runs_only_forward(model)
    for _ in range(max_new_tokens):
        if len(ids) - start > model.context:
            start = len(ids) - keep
            if cache is not None:
                cache.reset()
        new = ids[start + (0 if cache is None else cache.length) :]  # what the cache lacks, or all
        if cache is not None and len(new) == 1 and not model.training:
            logits = model.decode(prompt.new_tensor([new]), cache, direct=direct)[0, -1]
        else:
            logits = model(prompt.new_tensor([new]), cache=cache, logits_to_keep=1)[0, -1]
        if penalized and seen is None:
            seen = _seen([ids], logits.shape[-1], logits.device)[0]
        nxt = next_token(logits, seen=seen, generator=generator, **options)
        if nxt == eos_id:
            return
        ids.append(nxt)
        if seen is not None:
            seen[nxt] = True
        yield nxt


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **options: Any) -> torch.Tensor:
    """The new ids (1-D) `stream` yields from `model` for `prompt` (1-D ids), with its keyword `options`.

    The same `generator` seed gives the same text on the same device: sampling draws from it alone.
    """
    return prompt.new_tensor(list(stream(model, prompt, max_new_tokens, **options)), dtype=torch.long)


class Rollout(NamedTuple):
    """What `sample_rows` decodes: per row, its new ids, their sampling log-probabilities and how it ended."""

    ids: list[list[int]]  # new ids, the stop id included where the row ended on one
    logprobs: list[torch.Tensor]  # float32 (len(ids[i]),): log softmax(logits / T) of each id (T 1 if greedy)
    stopped: list[bool]  # the row ended at one of the stop ids


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, L) of `prompts` right-aligned on a pad of 0, each row's padding count (B,))."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = [[0] * pad + p for pad, p in zip(pads, prompts, strict=True)]
    return torch.tensor(ids, device=device), torch.tensor(pads, device=device)


def _check_rows(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> None:
    """One-line ConfigError for an empty prompt, or a prompt and new ids that overflow the context."""
    if not prompts or min(len(p) for p in prompts) == 0:
        raise _empty_prompt()
    longest = max(len(p) for p in prompts)
    if longest > model.context:  # cut or skipped by the caller's policy: a window would change its text
        raise ConfigError(
            f"a prompt of {longest} tokens is longer than the model's context of {model.context}",
            key="prompt",
            value=str(longest),
            valid=(f"<= {model.context} tokens",),
        )
    # the last new id is never fed back: it takes no position in the cache
    room = model.context - longest + 1
    if max_new_tokens > room:
        raise ConfigError(
            f"max_new_tokens={max_new_tokens}: the longest prompt leaves room for {room} in the model's "
            f"context of {model.context}",
            key="max_new_tokens",
            value=str(max_new_tokens),
            valid=(f"<= {room}",),
        )


def _pick(
    logits: torch.Tensor, options: dict[str, Any], seen: torch.Tensor | None, generator: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's next id (B,), the logits it is scored under (B, V), fp32): the argmax at temperature
    0, else a draw from `text.sampling.filtered_probs` of logits / T on the generator's device; the
    tokens of `seen` (B, V) penalised first (`options`' repetition_penalty), the scores' logits not."""
    logits, temperature = logits.float(), options["temperature"]
    chosen = logits if seen is None else penalize_repeats(logits, seen, options["repetition_penalty"])
    if temperature == 0:
        return chosen.argmax(dim=-1), logits
    scaled = logits / temperature
    limits = {k: options[k] for k in ("top_k", "top_p", "min_p")}
    probs = filtered_probs(chosen / temperature if seen is not None else scaled, **limits)
    where = probs.device if generator is None else generator.device
    picked = torch.multinomial(probs.to(where), 1, generator=generator).squeeze(1)
    return picked.to(logits.device), scaled


def sample_rows(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_ids: Collection[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
    group_size: int = 1,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Up to `max_new_tokens` new ids after each of `prompts` (any lengths), `group_size` rows per prompt
    (a GRPO group: prompt i's rows are i*group_size...), decoded as one left-padded batch against one KV
    cache; each row's ids are the ones it decodes alone (`stream`'s, where they fit the context).

    Sampling is `text.sampling`'s (temperature 0: greedy), the draws from `generator` alone, so a seed
    gives the same rows. A row ends at one of `stop_ids` (kept, with its log-probability, as a trainer
    scores the end of turn) or once `stop(its new ids)` holds; the batch ends when every row has. The
    log-probabilities are of the tempered distribution before top-k/top-p/min-p and the repetition
    penalty (each row's prompt and new ids; not the left padding, which Hugging Face's would count), which
    a training forward computes (`log_softmax(logits / temperature)`), in fp32.
    """
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    rows = [list(p) for p in prompts for _ in range(group_size)]
    _check_rows(model, rows, max_new_tokens)
    device = next(model.parameters()).device
    options = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    options["repetition_penalty"] = repetition_penalty
    with without_autograd(device):
        return _decode_rows(model, rows, max_new_tokens, device, options, stop_ids, stop, generator)


def _decode_rows(
    model: nn.Module,
    rows: list[list[int]],
    max_new_tokens: int,
    device: torch.device,
    options: dict[str, Any],
    stop_ids: Collection[int],
    stop: Callable[[list[int]], bool] | None,
    generator: torch.Generator | None,
) -> Rollout:
    """`sample_rows`' decoding of `rows` (its prompts, repeated per group; `options` its sampling
    keywords), checked."""
    tokens, pads = left_padded(rows, device)
    cache = model.new_cache(len(rows))
    cache.pad_left(pads)
    direct = _runs_only_forward(model)
    logits = model(tokens, cache=cache, logits_to_keep=1)[:, -1]
    # (B, V): the tokens of each row so far (its prompt, not the padding), which the repetition penalty lowers
    seen = _seen(rows, logits.shape[-1], device) if options["repetition_penalty"] != 1.0 else None
    new: list[list[int]] = [[] for _ in rows]
    stopped, done = [False] * len(rows), [False] * len(rows)
    scores = []
    for step in range(max_new_tokens):
        picked, scaled = _pick(logits, options, seen, generator)
        if seen is not None:
            seen.scatter_(1, picked[:, None], True)
        # the chosen id's log-probability, without writing out the whole (B, V) log-softmax
        scores.append(scaled.gather(1, picked[:, None]).squeeze(1) - scaled.logsumexp(dim=-1))
        for i, token in enumerate(picked.tolist()):
            if not done[i]:
                new[i].append(token)
                stopped[i] = token in stop_ids
                done[i] = stopped[i] or (stop is not None and stop(new[i]))
        if all(done) or step == max_new_tokens - 1:
            break
        # decode is the eval-mode step; a training model (dropout) steps through its forward
        step_in = picked[:, None]
        if model.training:
            logits = model(step_in, cache=cache)[:, -1]
        else:
            logits = model.decode(step_in, cache, direct=direct)[:, -1]
    table = torch.stack(scores, dim=1).cpu() if scores else torch.zeros(len(rows), 0)
    return Rollout(new, [row[: len(ids)] for row, ids in zip(table, new, strict=True)], stopped)


def _seen(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(rows), `vocab`) bool: which ids each of `rows` holds."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, row in enumerate(rows):
        seen[i, torch.tensor(row, dtype=torch.long)] = True
    return seen.to(device)


def greedy_rows(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The greedy new ids of each of `prompts` (any lengths; `sample_rows` at temperature 0): each row's
    as `stream` gives it alone, where prompt and new ids fit the context. A row ends at `eos_id` (not
    kept) or once `stop(its new ids)` holds (kept, as `stream`'s caller sees it)."""
    stops = () if eos_id is None else (eos_id,)
    out = sample_rows(model, prompts, max_new_tokens, temperature=0.0, stop_ids=stops, stop=stop)
    return [ids[:-1] if end else ids for ids, end in zip(out.ids, out.stopped, strict=True)]


def _runs_only_forward(model: nn.Module) -> bool:
    """Whether no layer of `model` has a hook or a compiled call: then calling the forwards directly
    computes the same, without `Module.__call__`'s Python, a measurable share of a decoding step at the
    LM recipe's size (BENCHMARKS.md § Generation)."""
    return all(torch_internals.runs_only_forward(m) for m in model.modules())
