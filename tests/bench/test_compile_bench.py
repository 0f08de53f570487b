"""bench/compile.py: every case trains a step, and the recipe cases are the recipes' own models."""

from __future__ import annotations

import math

import pytest
import torch

from bench.compile import CASES, _worker


@pytest.mark.parametrize("name", ["lm_gpt", "asr_conformer_xs", "text_encoder", "small_cnn", "transformer8"])
def test_case_runs_a_training_step_with_a_finite_loss(name: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build()
    loss = case.loss(model, case.batch(torch.device("cpu")))
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    # every parameter trains but text_encoder's cls slot, which mean pooling (the recipe's) leaves unused
    assert len(grads) >= len(params) - 1 and all(torch.isfinite(g).all() for g in grads)


def test_recipe_cases_are_the_recipes_default_models() -> None:
    # the recipe rows in BENCHMARKS.md claim these are what `+task=...` trains: same class, same size
    from audio.conformer import ConformerCTC
    from text.gpt import GPT
    from text.models import TextClassifier

    models = {name: CASES[name].build() for name in ("lm_gpt", "asr_conformer_xs", "text_encoder")}
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert isinstance(models["lm_gpt"], GPT) and sizes["lm_gpt"] > 3_000_000
    assert isinstance(models["asr_conformer_xs"], ConformerCTC)
    assert 900_000 < sizes["asr_conformer_xs"] < 1_100_000  # "Conformer-CTC XS (~1.0M parameters)"
    assert isinstance(models["text_encoder"], TextClassifier)


def test_worker_reports_compile_and_step_times(tmp_path) -> None:
    # the bench's per-process worker with dynamo's eager backend (no C++ build): the fields the table prints
    out = _worker("text_encoder", "full", str(tmp_path), 2, "cpu", "eager")
    assert out["compiled"] == "full" and out["compile/compiles"] >= 1
    assert out["first_s"] > 0 and out["step_ms"] > 0 and out["eager_ms"] > 0


def test_worker_runs_the_step_under_autocast(tmp_path) -> None:
    # --autocast bf16 is how the recipes train on AMX CPUs and GPUs; the compiled and eager copies both use it
    # (small_cnn: CPUs without native bf16, such as AVX2 ones, emulate it: lm_gpt took minutes there)
    out = _worker("small_cnn", "full", str(tmp_path), 1, "cpu", "eager", autocast="bf16")
    assert out["compiled"] == "full" and out["step_ms"] > 0
    with pytest.raises(KeyError):
        _worker("small_cnn", "full", str(tmp_path), 1, "cpu", "eager", autocast="int8")


def test_artifacts_saved_by_the_cold_worker_are_loaded_by_a_resumed_one(
    tmp_path, monkeypatch: pytest.MonkeyPatch, torch_artifacts: list[bytes]
) -> None:
    # the "artif s" column: the cold process saves what a checkpoint would carry, a later one loads it
    # (dynamo's eager backend has no artifacts of its own: torch's save/load stand in)
    loaded = torch_artifacts
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))  # restored after the test
    art = tmp_path / "full.artifacts"
    _worker("small_cnn", "full", str(tmp_path / "a"), 0, "cpu", "eager", artifacts=str(art))
    assert art.is_file() and loaded == []
    out = _worker("small_cnn", "full", str(tmp_path / "b"), 0, "cpu", "eager", artifacts=str(art))
    assert loaded == [b"graphs"]
    assert out["compiled"] == "full" and "step_ms" not in out  # steps=0: start-up only


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_cold_pairs_print_each_ratio_and_the_median(capsys: pytest.CaptureFixture[str]) -> None:
    # --pairs: back-to-back full/regional cold compiles in fresh processes (eager backend: seconds each)
    import argparse

    from bench.compile import _cold_pairs

    args = argparse.Namespace(
        pairs=1, steps=1, device="cpu", threads=1, backend="eager", autocast="none", policies="full,regional"
    )
    ratios = _cold_pairs("small_cnn", args, None)
    assert len(ratios) == 1 and ratios[0] > 0  # regional/full first-step seconds of one pair
    assert len(capsys.readouterr().out.splitlines()) == 2  # the pair, then the median


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
@pytest.mark.parametrize("resumed", ["on", "off"])
def test_table_row_has_the_resumed_column_when_asked(
    resumed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # "artif s" costs one more process per compiled policy; --resumed off (the GPU script) leaves it out
    import argparse

    from bench.compile import _bench_model

    args = argparse.Namespace(
        steps=1, device="cpu", threads=1, backend="eager", autocast="none", policies="full", resumed=resumed
    )
    full = _bench_model("small_cnn", args, None)["full"]
    assert full["cold"]["compiled"] == full["warm"]["compiled"] == "full"
    if resumed == "on":  # a fresh cache dir started from the cold run's artifacts, start-up only
        assert full["resumed"]["first_s"] > 0 and "step_ms" not in full["resumed"]
    else:
        assert full["resumed"] is None
