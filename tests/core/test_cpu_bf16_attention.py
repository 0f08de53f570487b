"""core.attention's short bf16 CPU path: as accurate as SDPA's kernel, chosen by timing both, the choice
kept per shape class and cached only when measured on a quiet machine, invisible to the FLOP count."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

import core.attention.cpu_bf16 as sp
from core.attention import attention
from core.logging.throughput import count_flops
from tests.core.attention_reference import max_abs_errors, reference_attention
from tests.core.test_attention import DENSE_CASES, TOL_BF16, make_case

real_measure = sp._measure
CASES = ["plain", "causal", "causal_cross_lq_lt_lk", "gqa2_causal", "mqa", "length_one"]


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder and no remembered choices."""
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path))
    monkeypatch.setattr(sp, "_CHOICES", {})
    monkeypatch.setattr(sp, "_DECIDED", {})
    monkeypatch.setattr(sp, "MIN_SCORES", 0)  # the cases here are small
    return tmp_path


def timings(sdpa_ms: float, short_ms: float, calls: list | None = None):  # noqa: ANN201
    """A stand-in for `_measure` that reports these times on an idle host (and records its calls)."""

    def measure(*args: object) -> dict[str, float]:
        if calls is not None:
            calls.append(args)
        return {"sdpa_ms": sdpa_ms, "short_ms": short_ms, "others_cpus": 0.0}

    return measure


def errors(qkv: list[torch.Tensor], ref_kw: dict, fn) -> list[float]:  # noqa: ANN001
    """Max abs error (out, dq, dk, dv) of `fn` on fresh leaves of `qkv` against the float64 reference."""
    leaves = [t.detach().requires_grad_() for t in qkv]
    out = fn(*leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in qkv]
    return max_abs_errors(out, reference_attention(*ref_leaves, **ref_kw), leaves, ref_leaves)


#: queries longer than the keys (top-left causal: the last queries see every key, unmasked)
LONG_QUERIES = dict(shape=(2, 4, 2, 23, 9, 16), kw=dict(causal=True))


@pytest.mark.parametrize("block", [None, 4, 1])
@pytest.mark.parametrize("case", [*CASES, "long_queries"])
def test_as_accurate_as_sdpa_in_bf16(case: str, block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # against float64 on the same rounded inputs: within twice SDPA's own bf16 error, plus a floor of a
    # tenth of the bf16 bound where both are at rounding level; with `block`, causal queries go in blocks
    # of that many (uneven last blocks, fewer and more queries than keys, grouped k/v heads). Blocks of one
    # query would be 23 for long_queries, whose key gradients (23 bf16 roundings) then miss this bound:
    # MAX_BLOCKS keeps them to 4
    if block is not None:
        monkeypatch.setattr(sp, "QUERY_BLOCK", block)
    qkv, ref_kw, _ = make_case(LONG_QUERIES if case == "long_queries" else DENSE_CASES[case], torch.bfloat16)
    causal = ref_kw.get("causal", False)
    scale = 1 / math.sqrt(qkv[0].shape[-1])
    ours = errors(qkv, ref_kw, lambda *t: sp.short_attention(*t, causal=causal, scale=scale))
    sdpa = errors(qkv, ref_kw, lambda *t: attention(*t, backend="sdpa", **ref_kw))
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa, strict=True):
        assert a <= 2 * b + TOL_BF16 / 10, f"{name}: short {a:.3g} vs SDPA {b:.3g}"


@pytest.mark.parametrize(("sdpa_ms", "short_ms", "short"), [(10.0, 4.0, True), (10.0, 9.5, False)])
def test_auto_follows_the_timing_and_keeps_it(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, sdpa_ms: float, short_ms: float, short: bool
) -> None:
    calls: list = []
    monkeypatch.setattr(sp, "_measure", timings(sdpa_ms, short_ms, calls))
    qkv, ref_kw, _ = make_case(DENSE_CASES["gqa2_causal"], torch.bfloat16)
    out = attention(*qkv, causal=True)
    expected = sp.short_attention(*qkv, causal=True, scale=1 / math.sqrt(qkv[0].shape[-1]))
    if not short:  # 1.05x is inside MARGIN: SDPA stays
        expected = attention(*qkv, causal=True, backend="sdpa")
    assert torch.equal(out, expected)
    saved = list((fresh / "device").glob("attention-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["sdpa_ms"] == sdpa_ms
    attention(*qkv, causal=True)
    monkeypatch.setattr(sp, "_CHOICES", {})  # a new process: reads the file, does not measure
    assert torch.equal(attention(*qkv, causal=True), expected)
    assert len(calls) == 1
    # forward only (no grad) is another measurement
    with torch.no_grad():
        attention(*(t.detach() for t in qkv), causal=True)
    assert len(calls) == 2 and calls[1][-1] is False


def test_only_bf16_cpu_tensors_within_the_score_limit(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_measure", timings(10.0, 1.0))
    q = torch.randn(2, 2, 64, 16)
    assert not sp.eligible(q, q, q)  # fp32: SDPA's kernel is at least as fast (BENCHMARKS.md § Attention)
    qb = q.bfloat16()
    assert sp.eligible(qb, qb, qb)
    monkeypatch.setattr(sp, "SCORE_BYTES_LIMIT", 2 * 2 * 64 * 64 * 2 - 1)
    assert not sp.eligible(qb, qb, qb)
    monkeypatch.setattr(sp, "SCORE_BYTES_LIMIT", 2**40)
    monkeypatch.setattr(sp, "MIN_SCORES", 2 * 2 * 64 * 64 + 1)  # too small to be worth a timing
    assert not sp.eligible(qb, qb, qb)
    assert torch.equal(attention(qb, qb, qb, causal=True), attention(qb, qb, qb, causal=True, backend="sdpa"))


def test_the_flop_count_is_the_same_on_either_path_and_never_counts_a_timing(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    qkv, _, _ = make_case(DENSE_CASES["causal"], torch.bfloat16)

    def step() -> None:
        attention(*qkv, causal=True).sum().backward()

    monkeypatch.setattr(sp, "_measure", timings(1.0, 10.0))  # SDPA faster
    on_sdpa = count_flops(step)
    b, h, lq, d = qkv[0].shape
    assert on_sdpa == 3 * 4 * b * h * lq * qkv[1].shape[2] * d  # forward's two matmuls, backward twice that
    # a real timing inside the counted step (the trainer counts its first batch before any other step),
    # then the short path: the count is the step's alone
    monkeypatch.setattr(sp, "_measure", real_measure)
    monkeypatch.setattr(sp, "_CHOICES", {})
    monkeypatch.setattr(sp, "MARGIN", 0.0)  # whatever the timing says, the short path
    assert count_flops(step) == on_sdpa
    assert list(sp._DECIDED.values()) == [True]


@pytest.mark.skipif(sp.cpu_bf16_causal is None, reason="torch < 2.4: no custom ops, causal stays unblocked")
@pytest.mark.parametrize(("block", "fraction"), [(64, 1.0), (32, 3 / 4), (16, 5 / 8), (8, 9 / 16)])
def test_blocks_score_only_what_the_mask_lets_through_and_count_as_whole(
    monkeypatch: pytest.MonkeyPatch, block: int, fraction: float
) -> None:
    q, k, v = (torch.randn(2, 3, 64, 16).bfloat16() for _ in range(3))
    # the probabilities the op keeps for backward are the scores it computed: (n+1)/(2n) of the matrix at n
    # blocks (the op as called; attention() asks for at most MAX_BLOCKS)
    rows = q.view(6, 64, 1, 16)
    _, *probs = sp.cpu_bf16_causal.short_causal_fwd(rows, k.view(6, 64, 16), v.view(6, 64, 16), 0.25, block)
    assert sum(p.numel() for p in probs) == fraction * 6 * 64 * 64
    # the model-FLOPs rule counts the whole matrix either way, as it does for SDPA's kernels (which skip
    # masked blocks too): forward's two matmuls, backward twice that
    leaves = [t.requires_grad_() for t in (q, k, v)]
    monkeypatch.setattr(sp, "QUERY_BLOCK", block)
    flops = count_flops(lambda: sp.short_attention(*leaves, causal=True, scale=0.25).sum().backward())
    assert flops == 3 * 4 * 2 * 3 * 64 * 64 * 16


@pytest.mark.skipif(sp.cpu_bf16_causal is None, reason="torch < 2.4: no custom ops, causal stays unblocked")
def test_each_block_reads_only_the_keys_its_queries_see() -> None:
    # (first query, end query, end key): a short last block, fewer queries than keys (the keys past the last
    # query are never read), more queries than keys (the late blocks see every key, unmasked)
    assert sp.cpu_bf16_causal.spans(256, 256, 128) == [(0, 128, 128), (128, 256, 256)]
    assert sp.cpu_bf16_causal.spans(7, 23, 4) == [(0, 4, 4), (4, 7, 7)]
    assert sp.cpu_bf16_causal.spans(23, 9, 6) == [(0, 6, 6), (6, 12, 9), (12, 18, 9), (18, 23, 9)]


@pytest.mark.skipif(sp.cpu_bf16_causal is None, reason="torch < 2.4: no custom ops, causal stays unblocked")
def test_blocks_trace_as_one_op_with_the_same_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    # compiled code sees the op through its fake kernels and registered backward (aot_eager: the traced
    # graphs run eagerly, no C++ compiler needed)
    monkeypatch.setattr(sp, "QUERY_BLOCK", 16)
    qkv, _, _ = make_case(dict(shape=(2, 4, 2, 40, 40, 16), kw={}), torch.bfloat16)

    def run(fn) -> list[torch.Tensor]:  # noqa: ANN001
        leaves = [t.detach().requires_grad_() for t in qkv]
        out = fn(*leaves)
        out.float().square().sum().backward()
        return [out, *(t.grad for t in leaves)]

    fn = lambda *t: sp.short_attention(*t, causal=True, scale=0.25)  # noqa: E731
    torch.compiler.reset()
    try:
        compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    finally:
        torch.compiler.reset()
    for a, b in zip(compiled, run(fn), strict=True):
        assert torch.equal(a, b)


def test_compiled_code_takes_the_path_chosen_eagerly(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_measure", timings(10.0, 1.0))
    qkv, _, _ = make_case(DENSE_CASES["causal"], torch.bfloat16)
    scale = 1 / math.sqrt(qkv[0].shape[-1])

    def compiled() -> torch.Tensor:
        torch.compiler.reset()
        return torch.compile(lambda *t: attention(*t, causal=True), backend="eager")(*qkv)

    assert torch.equal(compiled(), attention(*qkv, causal=True, backend="sdpa"))  # nothing chosen yet
    assert not sp._DECIDED  # tracing timed nothing
    attention(*qkv, causal=True)  # eager: timed, short chosen
    assert torch.equal(compiled(), sp.short_attention(*qkv, causal=True, scale=scale))
    torch.compiler.reset()


def test_a_slow_first_pair_is_the_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    # where bf16 is emulated (no bf16 instructions) one call can take seconds: after the warm-ups, the first
    # timed pair decides
    calls = []
    real_short = sp.short_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_short(*args, **kwargs)

    monkeypatch.setattr(sp, "short_attention", counted)
    assert sp._measure((2, 2, 64, 64, 16), 1, True, True)["short_ms"] > 0 and len(calls) == 1 + sp.REPS
    monkeypatch.setattr(sp, "SLOW_MS", 0.0)
    assert sp._measure((2, 2, 64, 64, 16), 1, True, True)["short_ms"] > 0 and len(calls) == 1 + sp.REPS + 2


def test_a_first_calls_one_time_setup_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    # a process's first SDPA call at 1k keys took 4x its later ones; timed, it made the short path look faster
    calls = []
    real_sdpa = sp._sdpa

    def first_slow(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.6)  # past SLOW_MS on its own
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(sp, "_sdpa", first_slow)
    timing = sp._measure((2, 2, 64, 64, 16), 1, True, True)
    assert len(calls) == 1 + sp.REPS and timing["sdpa_ms"] < 300


@pytest.mark.slow  # two spinning processes: kept out of the default run, where they would slow its neighbours
def test_a_real_measurement_is_cached_only_when_quiet(fresh: Path) -> None:
    from bench.load import background

    shape = (2, 2, 64, 64, 16)
    quiet = sp._measure(shape, 1, True, True)
    assert quiet["sdpa_ms"] > 0 and quiet["short_ms"] > 0
    with background("spin", 2):
        time.sleep(0.5)  # the spinning processes are up before the measurement starts
        q = torch.randn(2, 2, 64, 16).bfloat16().requires_grad_()
        k = torch.randn(2, 1, 64, 16).bfloat16().requires_grad_()
        out = attention(q, k, k, causal=True)
    assert not list((fresh / "device").glob("attention-*.json"))  # measured under load: decides nothing
    assert torch.equal(out, attention(q, k, k, causal=True, backend="sdpa"))


def test_a_resumed_run_keeps_the_paths_its_checkpoint_trained_with(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.checkpoint.layout import read_meta
    from tests.helpers import toy_trainer
    from text.lm import LanguageModeling

    def fit(steps: int, **kw: object) -> None:
        gpt = {"name": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32}
        task = LanguageModeling(model=gpt, data={"name": "kjv"}, context=32, val_chunks=1)
        run = toy_trainer(tmp_path / "run", task=task, precision="bf16", max_steps=steps, ckpt_every=2, **kw)
        run.fit()

    monkeypatch.setattr(sp, "_measure", timings(10.0, 1.0))  # the short path, on a quiet host
    fit(2)
    meta = read_meta(next((tmp_path / "run").glob("**/meta.json")).parent)
    trained = {(tuple(r[0]), r[1], r[2], r[3]) for r in meta["attention"]}
    assert trained and all(r[-1] is True for r in meta["attention"])
    # a new process where a timing would now pick SDPA (the first run's files gone): the checkpoint decides
    monkeypatch.setattr(sp, "_CHOICES", {})
    monkeypatch.setattr(sp, "_DECIDED", {})
    for f in (fresh / "device").glob("attention-*.json"):
        f.unlink()
    monkeypatch.setattr(sp, "_measure", timings(1.0, 10.0))
    fit(4, resume="auto")
    assert all(sp._DECIDED[k] for k in trained)


def test_adopt_takes_well_formed_rows_only(fresh: Path) -> None:
    good = [[16, 6, 256, 256, 64], 6, True, True, True]
    short_shape, yes = [[16, 6, 256, 256], 6, True, True, True], [[16, 6, 256, 256, 64], 6, True, True, "yes"]
    sp.adopt([["x"], short_shape, yes, 5])
    sp.adopt({"rows": good})
    assert sp.decisions() == []
    sp.adopt([good])
    assert sp.decisions() == [good]


def test_a_length_that_varies_compiles_once_dynamic_and_keeps_sdpa(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the short path's shape class rounds the length up to a power of two: on a dynamic length that rounding
    # pinned the length, so each new one (a GRPO batch's prompt + completion) compiled the graph again
    monkeypatch.setattr(sp, "_measure", timings(10.0, 1.0))  # eager would take the short path
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:  # noqa: ARG001
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    try:
        fn = torch.compile(lambda *t: attention(*t, causal=True), backend=counting)
        for n in (80, 97, 113, 130):  # each past MIN_SCORES at 2 x 8 heads: the short path is eligible
            qkv = [torch.randn(2, 8, n, 16).bfloat16() for _ in range(3)]
            assert sp.eligible(*qkv)
            assert torch.equal(fn(*qkv), attention(*qkv, causal=True, backend="sdpa"))
    finally:
        torch.compiler.reset()
    assert len(graphs) == 2  # the first length static, then one graph for every length
