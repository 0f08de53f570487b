"""Generation: the KV-cached path gives the full forward's tokens; batches of mixed lengths give each row's
own tokens; the batched sampler's log-probabilities; sampling settings; stop strings.

Token-for-token comparisons run the random models in float64, where the two paths' logits agree to ~1e-15 and
no argmax can flip on rounding; the trained model's peaked logits make float32 safe as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from tests.helpers import fault
from text.generation import Rollout, generate, greedy_rows, sample_rows
from text.gpt import GPT
from text.llama import DecoderConfig, Llama
from text.lm import LanguageModeling
from text.sampling import check_sampling, filtered_probs, next_token, penalize_repeats

CONTEXT = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Matmuls this small gain nothing from a second thread, and lose ~10x to its waits on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def random_gpt() -> GPT:
    """A tiny random GPT with weights wide enough that greedy text varies (GPT-2 init is nearly uniform)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=40, context=CONTEXT, n_layer=2, n_head=2, d_model=32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.double()


SENTENCE = "In the beginning God created the heaven and the earth. "


@pytest.fixture(scope="module")
def trained_gpt() -> GPT:
    """A byte-level GPT that has memorised one sentence (600 steps of a 1-layer model, about two seconds)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=258, context=CONTEXT, n_layer=1, n_head=2, d_model=32)
    data = torch.tensor(list((SENTENCE * 8).encode()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(600):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (8,))
        x = torch.stack([data[s : s + CONTEXT] for s in starts])
        y = torch.stack([data[s + 1 : s + CONTEXT + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def greedy(model: GPT, prompt: list[int], n: int, **options: object) -> list[int]:
    return generate(model, torch.tensor(prompt), n, temperature=0.0, **options).tolist()


def test_cached_forward_in_chunks_matches_one_full_forward(random_gpt: GPT) -> None:
    tokens = torch.randint(0, 40, (2, CONTEXT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = random_gpt(tokens)
        cache = random_gpt.new_cache(batch=2)
        # a prefill, single tokens, and chunks that start after position 0 (the offset causal mask)
        cuts = [0, 7, 8, 9, 15, 16, 30, CONTEXT]
        chunks = [random_gpt(tokens[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:], strict=False)]
    got = torch.cat(chunks, 1)
    assert cache.length == CONTEXT
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)  # float64, same math in another order


def test_a_layer_hook_still_runs_at_every_cached_step(random_gpt: GPT) -> None:
    prompt = [1, 2, 3]
    plain = greedy(random_gpt, prompt, 20)
    calls = []
    handle = random_gpt.blocks[1].fc.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    try:
        hooked = greedy(random_gpt, prompt, 20)
    finally:
        handle.remove()
    assert hooked == plain
    assert calls == [3] + [1] * 19  # the prefill, then one call per decoded token


def test_a_full_cache_refuses_one_more_token(random_gpt: GPT) -> None:
    cache = random_gpt.new_cache()
    with torch.no_grad():
        random_gpt(torch.zeros(1, CONTEXT, dtype=torch.long), cache=cache)
        with pytest.raises(ConfigError) as e:
            random_gpt(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert fault(e.value) == ("kv_cache", str(CONTEXT + 1), (f"<= {CONTEXT}",))


@pytest.mark.parametrize(
    ("prompt_len", "overflow_keep"),
    [
        (3, None),  # 3 + 200 tokens: the window slides (half the context kept) about a dozen times
        (3, CONTEXT),  # the window slides by one token at every step past the context
        (3, 5),
        (CONTEXT + 18, None),  # a prompt longer than the context
        (CONTEXT, 1),
    ],
)
def test_cached_greedy_tokens_equal_the_uncached_ones_for_200_new_tokens(
    random_gpt: GPT, prompt_len: int, overflow_keep: int | None
) -> None:
    prompt = torch.randint(0, 40, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    cached = greedy(random_gpt, prompt, 200, overflow_keep=overflow_keep)
    uncached = greedy(random_gpt, prompt, 200, overflow_keep=overflow_keep, use_cache=False)
    assert len(cached) == 200 and len(set(cached)) >= 4  # varied text: a flat model compares nothing
    assert cached == uncached


def test_keeping_the_whole_context_is_a_full_forward_over_the_last_context_tokens(random_gpt: GPT) -> None:
    ids = [1, 2, 3]
    with torch.no_grad():
        for _ in range(100):  # the pre-cache generate loop, written out
            ids.append(int(random_gpt(torch.tensor([ids[-CONTEXT:]]))[0, -1].argmax()))
    assert greedy(random_gpt, [1, 2, 3], 100, overflow_keep=CONTEXT) == ids[3:]


def test_cached_greedy_equals_uncached_on_a_trained_model_in_float32(trained_gpt: GPT) -> None:
    prompt = list(b"In the")
    cached = greedy(trained_gpt, prompt, 200)
    assert cached == greedy(trained_gpt, prompt, 200, use_cache=False)
    assert bytes(cached).decode().startswith(" beginning God created the heaven and the earth.")


def test_top_k_1_and_a_tiny_top_p_give_the_greedy_tokens(random_gpt: GPT) -> None:
    prompt = torch.tensor([4, 5, 6])
    want = greedy(random_gpt, [4, 5, 6], 60)
    g = torch.Generator().manual_seed(0)
    assert generate(random_gpt, prompt, 60, temperature=1.0, top_k=1, generator=g).tolist() == want
    assert generate(random_gpt, prompt, 60, temperature=1.0, top_p=1e-6, generator=g).tolist() == want


def test_a_seed_reproduces_sampling_and_the_cache_does_not_change_it(random_gpt: GPT) -> None:
    prompt = torch.tensor([7, 8])

    def sample(seed: int, **options: object) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return generate(random_gpt, prompt, 80, temperature=0.9, top_p=0.9, generator=g, **options).tolist()

    assert sample(3) == sample(3) == sample(3, use_cache=False)
    assert sample(3) != sample(4)


def test_top_p_samples_from_the_fewest_likeliest_tokens_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)

    def drawn(**options: object) -> set[int]:
        return {next_token(logits, temperature=1.0, generator=g, **options) for _ in range(400)}

    assert drawn(top_p=0.7) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert drawn(top_p=0.85) == {0, 1, 2}
    assert drawn(top_p=1.0) == {0, 1, 2, 3}
    assert drawn(top_k=2, top_p=0.95) == {0, 1}  # top-k first, then top-p over what is left


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)

    def drawn(**options: object) -> set[int]:
        return {next_token(logits, temperature=1.0, generator=g, **options) for _ in range(400)}

    assert drawn(min_p=0.5) == {0, 1}  # 0.3 >= 0.25, 0.15 < 0.25
    assert drawn(min_p=0.2) == {0, 1, 2}
    assert drawn(min_p=0.0) == {0, 1, 2, 3}
    assert drawn(min_p=1.0) == {0}


@pytest.mark.parametrize("penalty", [1.0, 1.4, 0.7])
@pytest.mark.parametrize("min_p", [None, 0.05, 0.3])
def test_the_filters_and_the_repetition_penalty_give_hugging_faces_logits_processors_distribution(
    min_p: float | None, penalty: float
) -> None:
    lp = pytest.importorskip(
        "transformers.generation.logits_process", reason="transformers (the `hf` extra) is not installed"
    )
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 1.5
    ids = torch.randint(0, 50, (4, 12), generator=g)  # each row's sequence so far
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter(1, ids, True)
    ours = filtered_probs(penalize_repeats(logits, seen, penalty) / 0.8, top_k=30, top_p=0.9, min_p=min_p)
    ours = ours / ours.sum(-1, keepdim=True)
    scores = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    warpers = [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(30), lp.TopPLogitsWarper(0.9)]
    warpers += [lp.MinPLogitsWarper(min_p)] if min_p is not None else []
    for warp in warpers:
        scores = warp(ids, scores)
    theirs = scores.softmax(-1)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (theirs > 0).sum() > 8  # the filters left choices to compare


def test_a_repetition_penalty_leaves_the_sampling_log_probs_the_forwards(decoder: torch.nn.Module) -> None:
    prompts = prompts_of(3, 8)
    g = torch.Generator().manual_seed(0)
    out = sample_rows(decoder, prompts, 10, temperature=0.9, repetition_penalty=1.3, min_p=0.05, generator=g)
    plain = sample_rows(decoder, prompts, 10, temperature=0.9, generator=torch.Generator().manual_seed(0))
    assert out.ids != plain.ids  # the penalty and min-p change the draws
    for prompt, ids, logprobs in zip(prompts, out.ids, out.logprobs, strict=True):
        with torch.no_grad():
            logits = decoder(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1]
        # the tempered distribution before the penalty and the filters, as a training forward scores it
        want = (logits / 0.9).log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ((-0.5, None, None), ("temperature", "-0.5", (">= 0",))),
        ((1.0, -1, None), ("top_k", "-1", (">= 0",))),
        ((1.0, None, 0.0), ("top_p", "0.0", ("> 0 and <= 1",))),
        ((1.0, None, 1.5), ("top_p", "1.5", ("> 0 and <= 1",))),
        ((1.0, None, None, 1.5), ("min_p", "1.5", (">= 0 and <= 1",))),
        ((1.0, None, None, None, 0.0), ("repetition_penalty", "0.0", ("> 0",))),
    ],
)
def test_bad_sampling_settings_are_config_errors(settings: tuple, expected: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        check_sampling(*settings)
    assert fault(e.value) == expected


def test_overflow_keep_outside_the_context_is_a_config_error(random_gpt: GPT) -> None:
    with pytest.raises(ConfigError) as e:
        greedy(random_gpt, [1], 5, overflow_keep=CONTEXT + 1)
    assert fault(e.value) == ("overflow_keep", str(CONTEXT + 1), (f">= 1 and <= {CONTEXT}",))


class ScriptedModel(torch.nn.Module):
    """Stands in for a GPT: its `stream` (in place of `text.generation.stream`) yields the bytes of a fixed
    text, counting what it was asked for."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.yielded = text, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the task reads the device from a parameter

    def stream(self, prompt: torch.Tensor, max_new_tokens: int, **options: object) -> Iterator[int]:
        for b in self.text.encode()[:max_new_tokens]:
            self.yielded += 1
            yield b


def lm_task(tmp_path: Path) -> LanguageModeling:
    (tmp_path / "a.txt").write_text(SENTENCE * 4)
    model = {"name": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32}
    return LanguageModeling(model=model, data={"name": "text_files", "root": str(tmp_path)}, context=CONTEXT)


@pytest.mark.parametrize(
    ("prompt", "stop", "want"),
    [
        ("Q:", ".", "Q: wise"),
        ("Q:", ["\n\n", "."], "Q: wise"),  # whichever comes first
        ("Q:", ["no", "\n\n"], "Q: wise. men"),
        ("Q:", "é", "Q: wise. men\n\nA: "),  # a two-byte character: found once both bytes are out
        ("Q: why.", ".", "Q: why. wise"),  # a stop string in the prompt does not count
        ("Q:", (), "Q: wise. men\n\nA: é no. Tail"),
    ],
)
def test_stop_strings_cut_the_continuation_before_the_first_one(
    tmp_path: Path, prompt: str, stop: str | list[str], want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the task samples through text.generation.stream: here it asks the scripted model instead
    monkeypatch.setattr("text.lm.stream", lambda model, prompt, n, **options: model.stream(prompt, n))
    model = ScriptedModel(" wise. men\n\nA: é no. Tail")
    assert lm_task(tmp_path).generate(model, prompt, stop=stop) == want
    new = model.text.encode()
    stops = [stop] if isinstance(stop, str) else stop
    first_end = min((new.find(s.encode()) + len(s.encode()) for s in stops), default=len(new))
    assert model.yielded == first_end  # no token is sampled after the stop string is complete


def test_a_trained_model_stops_at_the_stop_string(tmp_path: Path, trained_gpt: GPT) -> None:
    task = lm_task(tmp_path)
    out = task.generate(trained_gpt, "In the", temperature=0.0, stop=[" and", "."])
    assert out == "In the beginning God created the heaven"


def wide(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with N(0, 0.3) matrices: GPT-2's init is nearly uniform, so greedy text varies
    little and an argmax could flip on rounding; these logits are far apart."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=["gpt", "llama"])
def decoder(request: pytest.FixtureRequest) -> torch.nn.Module:
    """Each decoder with a KV cache, tiny, random, float32."""
    torch.manual_seed(0)
    if request.param == "gpt":
        return wide(GPT(vocab_size=40, context=CONTEXT, n_layer=2, n_head=2, d_model=32))
    sizes = DecoderConfig(
        vocab_size=40, context=CONTEXT, n_layer=2, n_head=4, n_kv_head=2, d_model=32, hidden=64
    )
    return wide(Llama(sizes))


def prompts_of(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 40, (n,), generator=g).tolist() for n in lengths]


def test_a_batch_of_mixed_lengths_gives_each_row_its_own_greedy_tokens(decoder: torch.nn.Module) -> None:
    prompts = prompts_of(3, 9, 1, 15, 9)
    batch = greedy_rows(decoder, prompts, 16)
    alone = [greedy_rows(decoder, [p], 16)[0] for p in prompts]
    assert batch == alone  # float32, exact ids
    assert alone == [greedy(decoder, p, 16) for p in prompts]  # and what `stream` decodes
    assert min(len(set(ids)) for ids in alone) >= 3  # varied text: a flat model compares nothing
    decoder.train()  # no dropout in these: a training model's steps (its forward, padded) decode the same
    try:
        assert greedy_rows(decoder, prompts, 16) == batch
    finally:
        decoder.eval()


def test_a_tiny_temperature_samples_the_greedy_tokens(decoder: torch.nn.Module) -> None:
    prompts = prompts_of(4, 7)
    g = torch.Generator().manual_seed(0)
    out = sample_rows(decoder, prompts, 12, temperature=1e-6, group_size=3, generator=g)
    want = greedy_rows(decoder, prompts, 12)
    assert out.ids == [ids for ids in want for _ in range(3)]


def test_sampling_log_probs_equal_a_teacher_forced_forward(decoder: torch.nn.Module) -> None:
    prompts = prompts_of(2, 11, 6)
    g = torch.Generator().manual_seed(0)
    out = sample_rows(decoder, prompts, 10, temperature=0.7, top_p=0.9, group_size=2, generator=g)
    assert len(out.ids) == 6 and {len(ids) for ids in out.ids} == {10}
    for row, (ids, logprobs) in enumerate(zip(out.ids, out.logprobs, strict=True)):
        prompt = prompts[row // 2]
        with torch.no_grad():
            logits = decoder(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1]
        # the tempered distribution before top-p, as a training forward computes it
        want = (logits / 0.7).log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=0)  # float32, padded batch vs one row


def test_rows_finish_independently_and_a_seed_reproduces_them(decoder: torch.nn.Module) -> None:
    prompts = prompts_of(5, 3, 8)

    def sample(seed: int, **options: object) -> Rollout:
        g = torch.Generator().manual_seed(seed)
        return sample_rows(decoder, prompts, 20, temperature=1.0, group_size=2, generator=g, **options)

    free = sample(0)
    again = sample(0)
    assert again.ids == free.ids and again.stopped == free.stopped
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, free.logprobs, strict=True))
    assert sample(1).ids != free.ids
    stop = free.ids[0][3]  # a token the first row draws: it ends there, the others where they draw it
    ended = sample(0, stop_ids=(stop,))
    for full, cut, end in zip(free.ids, ended.ids, ended.stopped, strict=True):
        first = full.index(stop) + 1 if stop in full else len(full)
        assert cut == full[:first] and end == (stop in full)  # every row draws at every step: same ids
    assert ended.stopped[0] and len({len(ids) for ids in ended.ids}) > 1
    for cut, logprobs, full in zip(ended.ids, ended.logprobs, free.logprobs, strict=True):
        torch.testing.assert_close(logprobs, full[: len(cut)], atol=0, rtol=0)


def test_new_tokens_past_the_context_are_a_config_error(decoder: torch.nn.Module) -> None:
    with pytest.raises(ConfigError) as e:
        greedy_rows(decoder, prompts_of(2, CONTEXT - 4), 6)
    assert fault(e.value) == ("max_new_tokens", "6", ("<= 5",))
    assert len(greedy_rows(decoder, prompts_of(2, CONTEXT - 4), 5)[1]) == 5  # the last id takes no position
    with pytest.raises(ConfigError) as e:
        greedy_rows(decoder, prompts_of(CONTEXT + 1), 1)
    assert fault(e.value) == ("prompt", str(CONTEXT + 1), (f"<= {CONTEXT} tokens",))


def test_under_autocast_the_cache_holds_its_dtype_and_decoding_keeps_the_weights_cast(
    decoder: torch.nn.Module,
) -> None:
    modes = set()
    hook = decoder.blocks[0].register_forward_hook(
        lambda *_: modes.add((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
    )
    prompt = prompts_of(6)[0]
    try:
        greedy_rows(decoder, [prompt], 3)
        assert modes == {(True, False)}  # fp32: inference mode
        modes.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert decoder.new_cache(2).keys.dtype == torch.bfloat16  # the projections' output dtype
            assert greedy_rows(decoder, [prompt], 10)[0] == greedy(decoder, prompt, 10)
        # no_grad, where autocast keeps its bf16 copies of the weights through the call (in inference
        # mode it casts every weight again at every token)
        assert modes == {(False, False)}
    finally:
        hook.remove()
    assert decoder.new_cache().keys.dtype == torch.float32
