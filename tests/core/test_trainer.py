"""core.loop.trainer: bit-exact resume, gradient accumulation, outputs on disk, bad settings."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from core import checkpoint
from core.errors import ConfigError, TrainingError
from core.loop.trainer import Trainer, TrainerConfig
from core.optim import OptimConfig
from tests.core.toy_task import MaskedToyTask, ToyTask
from tests.helpers import fault, fit_toy, read_metrics, toy_trainer


def _weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


@pytest.mark.arm64
@pytest.mark.parametrize(
    "ckpt", ["step_00000005", "step_00000008"]
)  # epoch boundary (5 steps/epoch), mid-epoch
def test_resume_is_bit_exact(tmp_path: Path, ckpt: str) -> None:
    straight = fit_toy(tmp_path / "a")
    ckpts = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert ckpt in ckpts and "step_00000015" in ckpts
    # a run interrupted right after `ckpt`: only that checkpoint survived
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = fit_toy(tmp_path / "b", resume="auto")
    for k, v in _weights(straight).items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


@pytest.mark.arm64
def test_gradient_accumulation_matches_large_batch(tmp_path: Path) -> None:
    task = ToyTask(jitter=0.0, dropout=0.0)
    big = fit_toy(tmp_path / "big", task=task, batch_size=16, grad_accum=1, max_epochs=1, grad_clip=0.0)
    acc = fit_toy(tmp_path / "acc", task=task, batch_size=8, grad_accum=2, max_epochs=1, grad_clip=0.0)
    for k, v in _weights(big).items():
        torch.testing.assert_close(acc.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)  # fp32 summation order


#: one plain gradient step: the weights move by exactly minus the gradient
SGD_LR1 = OptimConfig(
    name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, warmup_ratio=0.0, schedule="constant"
)


def _sgd_step(run_dir: Path, task: ToyTask, grad_accum: int, steps: int = 1) -> Trainer:
    t = toy_trainer(
        run_dir, task=task, optim=SGD_LR1, max_steps=steps, grad_accum=grad_accum, grad_clip=0.0, log_every=1
    )
    t.fit()
    return t


@pytest.mark.parametrize("ignore_every", [0, 4])
def test_accumulated_unequal_micro_batches_step_like_one_batch_of_their_examples(
    tmp_path: Path, ignore_every: int
) -> None:
    # the held-out check: 5 + 10 examples accumulated are one batch of the 15, one SGD step at lr 1
    # in float64 (the mean of the two micro-batch means was 0.41 away); also with ignored targets
    one = _sgd_step(tmp_path / "one", MaskedToyTask((15,), ignore_every), grad_accum=1)
    acc = _sgd_step(tmp_path / "acc", MaskedToyTask((5, 10), ignore_every), grad_accum=2)
    want, got = _weights(one), _weights(acc)
    assert want["0.weight"].dtype == torch.float64
    assert any(not torch.equal(w, p) for w, p in zip(want.values(), _weights_at_init().values(), strict=True))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-10)  # float64 summation order


def test_the_logged_loss_is_the_mean_over_the_groups_loss_units(tmp_path: Path) -> None:
    task = MaskedToyTask((5, 10), ignore_every=4)
    _sgd_step(tmp_path / "acc", task, grad_accum=2)
    one = MaskedToyTask((15,), ignore_every=4)
    _sgd_step(tmp_path / "one", one, grad_accum=1)
    rows = [read_metrics(tmp_path / run) for run in ("acc", "one")]
    acc_loss, one_loss = ([r["train/loss"] for r in run if "train/loss" in r] for run in rows)
    assert acc_loss == pytest.approx(one_loss, rel=1e-12)


def _weights_at_init() -> dict[str, torch.Tensor]:
    return dict(MaskedToyTask((1,)).build_model().state_dict())


def test_metrics_and_checkpoint_files(tmp_path: Path) -> None:
    fit_toy(tmp_path, max_epochs=2, keep_last=1)
    rows = read_metrics(tmp_path)
    evals = [r for r in rows if "val/accuracy" in r]
    assert len(evals) == 2 and {"val/loss", "best/val/accuracy", "epoch"} <= set(evals[-1])
    assert any("train/lr" in r and "train/grad_norm" in r for r in rows)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000010"]


@pytest.mark.arm64
def test_max_steps_stops_mid_epoch_and_resume_continues(tmp_path: Path) -> None:
    straight = fit_toy(tmp_path / "a", max_steps=7, max_epochs=5)
    last = tmp_path / "a" / "checkpoints" / "step_00000007"
    meta = json.loads((last / "meta.json").read_text())
    assert meta["epoch"] == 1 and meta["step"] == 7  # second epoch, 2 batches in
    assert torch.load(last / "train.pt", weights_only=True)["batch_in_epoch"] == 2
    # a run stopped at step 4 (first epoch) continues across the epoch boundary to the same mid-epoch stop
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "a" / "checkpoints" / "step_00000004", tmp_path / "b" / "checkpoints" / "step_00000004"
    )
    resumed = fit_toy(tmp_path / "b", resume="auto", max_steps=7, max_epochs=5)
    assert resumed.state.step == 7
    assert json.loads((tmp_path / "b" / "checkpoints" / "step_00000007" / "meta.json").read_text()) == meta
    steps = [r["step"] for r in read_metrics(tmp_path / "b")]
    assert sorted(set(steps)) == [5, 6, 7]  # the resumed run logged only the steps it trained
    for k, v in _weights(straight).items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


@pytest.mark.parametrize("key", ["batch_size", "grad_accum", "max_epochs"])
def test_bad_loop_settings_are_config_errors(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        Trainer(ToyTask(), TrainerConfig(**{key: 0}), OptimConfig(), run_dir=tmp_path)
    assert fault(e.value) == (f"trainer.{key}", "0", (">= 1",))


def test_compiled_runs_fill_short_batches_and_resume_bit_exact(
    tmp_path: Path, dynamo_only_compile: None
) -> None:
    # 43 examples in batches of 8: the 6th batch of each epoch has 3. Compiled, it is topped up to 8 (one
    # batch size, one graph), the epoch keeps 6 steps, and a run resumed mid-epoch replays the same batches
    from core.compile import CompileConfig

    sizes: list[int] = []

    class Recording(ToyTask):
        def step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> object:
            if model.training:  # evaluation batches are not topped up
                sizes.append(len(batch[1]))
            return super().step(model, batch)

    def fit(run_dir: Path, resume: str | None = None, compile_policy: str = "full") -> Trainer:
        cc = CompileConfig(policy=compile_policy, cache_dir=str(tmp_path / "cache"))
        t = toy_trainer(
            run_dir,
            task=Recording(n=43),
            max_epochs=3,
            ckpt_every=2,
            keep_last=100,
            resume=resume,
            compile_cfg=cc,
        )
        t.fit()
        return t

    torch._dynamo.reset()
    eager = fit(tmp_path / "eager", compile_policy="off")
    assert sizes.count(3) == 3  # eager keeps each epoch's short batch
    sizes.clear()
    straight = fit(tmp_path / "a")
    assert straight.model.compile_report.compiled == "full"
    # the FLOP count's step (core.logging.throughput), the compile probe step, then 6 full batches per epoch
    assert set(sizes) == {8} and len(sizes) == 2 + 3 * 6
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    ckpt = "step_00000008"  # epoch 1, batch 2
    shutil.copytree(tmp_path / "a" / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = fit(tmp_path / "b", resume="auto")
    for k, v in _weights(straight).items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    assert any(not torch.equal(v, eager.model.state_dict()[k]) for k, v in _weights(straight).items())
    torch._dynamo.reset()


def test_model_hook_that_compiles_runs_like_the_compile_stage(
    tmp_path: Path, dynamo_only_compile: None
) -> None:
    # the documented use, Trainer(model_hook=core.compile.apply...) with no compile_cfg: the loop must treat
    # the model as compiled (metrics, clean checkpoints, one batch size) without having imported anything
    from core import compile as kc

    probes: list[int] = []

    def hook(model: torch.nn.Module, probe: object) -> torch.nn.Module:
        probes.append(1)
        return kc.apply(model, kc.CompileConfig(policy="full"), probe=probe, backend="eager")

    torch._dynamo.reset()
    t = toy_trainer(
        tmp_path,
        task=ToyTask(n=43, dropout=0.0),
        optim=OptimConfig(),
        seed=0,
        max_epochs=1,
        log_every=2,
        model_hook=hook,
    )
    t.fit()
    torch._dynamo.reset()
    assert probes == [1] and t.compiled and t.model.compile_report.compiled == "full"
    rows = read_metrics(tmp_path)
    assert rows[0]["step"] == 2 and rows[0]["compile/compiles"] >= 1
    weights = torch.load(tmp_path / "checkpoints" / "step_00000006" / "model.pt", weights_only=True)
    assert sorted(weights) == ["0.bias", "0.weight", "3.bias", "3.weight"]


def test_model_hook_probe_runs_a_real_step_and_leaves_the_run_bit_exact(tmp_path: Path) -> None:
    grads: list[float] = []

    def hook(model: torch.nn.Module, probe: object) -> torch.nn.Module:
        probe(model)  # a training forward+backward on a real batch: gradients appear, RNG is untouched
        grads.append(float(sum(p.grad.abs().sum() for p in model.parameters())))
        return model

    plain = fit_toy(tmp_path / "plain")
    hooked = toy_trainer(tmp_path / "hooked", max_epochs=3, ckpt_every=2, model_hook=hook)
    hooked.fit()
    assert len(grads) == 1 and grads[0] > 0 and not hooked.compiled
    for k, v in _weights(plain).items():
        assert torch.equal(v, hooked.model.state_dict()[k]), k


class _NaNAt(ToyTask):
    """ToyTask whose loss is NaN on every training batch that holds sample `bad`."""

    def __init__(self, bad: int, **kw: object) -> None:
        super().__init__(**kw)
        self.bad = bad

    def build_datasets(self) -> tuple[object, object]:
        train, val = super().build_datasets()
        train.x[self.bad] = float("nan")  # one corrupt sample: its batch's loss is NaN
        return train, val


def test_a_non_finite_batch_is_skipped_counted_and_leaves_the_weights_finite(tmp_path: Path) -> None:
    t = fit_toy(tmp_path, task=_NaNAt(bad=5), max_epochs=2)
    assert all(torch.isfinite(v).all() for v in _weights(t).values())
    rows = read_metrics(tmp_path)
    skipped = [r["train/nonfinite_steps"] for r in rows if "train/nonfinite_steps" in r]
    assert skipped and skipped[-1] == 2.0  # sample 5's batch, once per epoch
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)


def test_abort_names_the_step_and_samples_and_the_last_finite_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(TrainingError) as err:
        fit_toy(tmp_path, task=_NaNAt(bad=5), nonfinite="abort")
    key, samples, _ = fault(err.value)
    assert key == "samples" and "5" in samples.split(", ") and len(samples.split(", ")) == 8  # one batch
    # the newest checkpoint with finite weights, which the message names: none (sample 5's batch came first)
    assert checkpoint.newest_with_finite_weights(tmp_path / "checkpoints") is None
    assert "\n" not in str(err.value)
    assert TrainingError.exit_code == 3


def test_a_diverging_recipe_stops_with_one_line_and_exit_3(tmp_path: Path, cli_here) -> None:
    r = cli_here(
        "+task=image_classification",
        "optim.lr=1e30",
        "trainer.max_epochs=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert r.returncode == 3, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: non-finite loss or gradients at step") and "Traceback" not in r.stderr


def test_a_run_ending_with_non_finite_weights_stops_naming_optim_lr_before_any_export(
    tmp_path: Path,
) -> None:
    from core.loop.callbacks import Callback

    class Diverge(Callback):
        """What lr=1e30 does to a short run: the last update leaves the weights non-finite, and the
        nonfinite-skip limit is never reached."""

        def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
            if trainer.state.step == trainer.total_steps:
                with torch.no_grad():
                    next(trainer.model.parameters()).fill_(float("nan"))

    t = toy_trainer(tmp_path / "run", callbacks=[Diverge()], optim=OptimConfig(lr=3e-3), max_steps=4)
    with pytest.raises(TrainingError) as e:
        t.fit()
    assert (e.value.key, e.value.value) == ("optim.lr", "0.003")
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.slow  # a real CLI run: tests/core/test_trainer.py's toy test above covers the check in-process
def test_a_two_step_run_at_lr_1e30_exits_3_and_exports_no_nan_weights(tmp_path: Path, cli_here) -> None:
    run = tmp_path / "run"
    r = cli_here("+task=image_classification", "trainer=smoke", "optim.lr=1e30", f"hydra.run.dir={run}")
    assert r.returncode == 3, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "optim.lr" in last and "Traceback" not in r.stderr  # the key
    assert not (run / "model.safetensors").exists() and not (run / "result.json").exists()


def test_ckpt_on_error_warn_trains_on_and_stop_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.errors import CheckpointWriteError

    disk_full = CheckpointWriteError("could not write checkpoint X: No space left on device")

    def full(*args: object, **kwargs: object) -> None:
        raise disk_full

    monkeypatch.setattr(checkpoint, "save", full)
    t = fit_toy(tmp_path / "warn", ckpt_on_error="warn")
    assert t.state.step == 15 and not (tmp_path / "warn" / "checkpoints").exists()
    with pytest.raises(CheckpointWriteError) as e:
        fit_toy(tmp_path / "stop")
    assert e.value is disk_full  # stop: the write's own error, not another
    with pytest.raises(ConfigError) as e:
        fit_toy(tmp_path / "bad", ckpt_on_error="maybe")
    assert fault(e.value) == ("trainer.ckpt_on_error", "maybe", ("stop", "warn"))


def test_resumed_adamw_moments_follow_their_weights_through_layout_upgrades() -> None:
    import copy

    from torch import nn

    from core.checkpoint.single import moments_like_weights
    from core.nn.transformer import Block
    from core.optim import build_optimizer
    from tests.core.qkv_layout import old_qkv_layout

    torch.manual_seed(0)
    model = nn.ModuleDict({"b": Block(16, 2, 0.0, False)})
    opt = build_optimizer(model, OptimConfig())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    want = copy.deepcopy(opt.state_dict())
    names = [n for n, _ in model.named_parameters()]
    # the checkpoint as an older version wrote it: weights and moments in the old q/k/v row order
    old_weights = old_qkv_layout(model.state_dict(), n_head=2)
    stale = copy.deepcopy(want)
    order = [n for g in opt.param_groups for p in g["params"] for n, q in model.named_parameters() if q is p]
    for kind in ("exp_avg", "exp_avg_sq"):
        old = old_qkv_layout({n: stale["state"][i][kind] for i, n in enumerate(order)}, n_head=2)
        for i, n in enumerate(order):
            stale["state"][i][kind] = old[n.replace("qkv_by_head", "qkv")]
    assert any("qkv_by_head" in n for n in names)
    assert not torch.equal(stale["state"][0]["exp_avg"], want["state"][0]["exp_avg"])  # qkv comes first
    moments_like_weights(model, list(old_weights), stale, opt)
    for i in want["state"]:
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(stale["state"][i][kind], want["state"][i][kind]), (i, kind)


# --- on a CUDA device (pytest -m gpu; skipped without one, tests/conftest.py) -----------------------------


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> object:
    """torch.use_deterministic_algorithms for the test (cuBLAS needs a fixed workspace: the env var is read
    when its handle is made, so scripts/gpu_checks.sh sets it before the process starts too)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["step_00000005", "step_00000008"])
def test_cuda_resume_is_bit_exact(tmp_path: Path, ckpt: str, deterministic: None) -> None:
    # as on CPU, with dropout drawn from the CUDA generator: its state must travel in the checkpoint
    straight = fit_toy(tmp_path / "a", device="cuda")
    assert next(straight.model.parameters()).is_cuda
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = fit_toy(tmp_path / "b", resume="auto", device="cuda")
    for k, v in _weights(straight).items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


@pytest.mark.gpu
def test_cuda_steps_match_cpu_steps(tmp_path: Path) -> None:
    # no dropout or jitter (CPU and CUDA draw differently): the same 15 steps. The CUDA plan runs fp32
    # matmuls as TF32 (10-bit mantissa, relative error ~1e-3 per product); weights of O(1): atol 5e-3
    task = ToyTask(jitter=0.0, dropout=0.0)
    cpu = fit_toy(tmp_path / "cpu", task=task)
    cuda = fit_toy(tmp_path / "cuda", task=task, device="cuda")
    for k, v in _weights(cpu).items():
        torch.testing.assert_close(cuda.model.state_dict()[k].cpu(), v, rtol=0, atol=5e-3)


@pytest.mark.gpu
def test_cuda_bf16_autocast_trains_like_fp32(tmp_path: Path) -> None:
    # bf16 autocast on CUDA (the plan's choice there): finite weights, validation loss near fp32's
    task = ToyTask(jitter=0.0, dropout=0.0)
    losses = {}
    for precision in ("fp32", "bf16"):
        t = fit_toy(tmp_path / precision, task=task, device="cuda", precision=precision)
        assert all(torch.isfinite(v).all() for v in _weights(t).values())
        losses[precision] = [r["val/loss"] for r in read_metrics(tmp_path / precision) if "val/loss" in r][-1]
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.05)
