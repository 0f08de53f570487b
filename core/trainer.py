"""The one training loop every torchkiln task runs through.

Read top to bottom: set up (device plan, model, data, optimizer, resume), then epochs of
accumulate -> clip -> step, with evaluation and atomic checkpoints at step or epoch boundaries.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from core import checkpoint
from core.compile import CompileConfig, is_compiled
from core.data import ResumableBatchSampler
from core.device import DevicePlan, resolve
from core.errors import ConfigError
from core.metrics import MetricsLogger
from core.optim import OptimConfig, build_optimizer, build_scheduler
from core.rng import rng_state, seed_everything, set_rng_state
from core.task import Task


@dataclass
class TrainerConfig:
    """Loop settings; steps count optimizer steps (after gradient accumulation)."""

    max_epochs: int = 20
    max_steps: int = -1
    batch_size: int = 64
    eval_batch_size: int = 0
    grad_accum: int = 1
    grad_clip: float = 1.0
    eval_every: int = 0
    ckpt_every: int = 0
    keep_last: int = 2
    log_every: int = 20
    num_workers: int = -1
    progress: bool = True
    tensorboard: bool = True


#: hook that may replace the model before training, e.g. core.compile.apply; gets a probe that runs one step
ModelHook = Callable[[nn.Module, Callable[[nn.Module], None]], nn.Module]


class Trainer:
    """Drives a `Task`: build, (resume), train with accumulation/clipping/AMP, evaluate, checkpoint."""

    def __init__(
        self,
        task: Task,
        cfg: TrainerConfig,
        optim: OptimConfig,
        *,
        run_dir: Path | str,
        device: str = "auto",
        precision: str = "auto",
        seed: int = 0,
        resume: str | None = None,
        mps_fallback: bool = False,
        compile_cfg: CompileConfig | None = None,
        model_hook: ModelHook | None = None,
    ) -> None:
        """Configure a run writing into `run_dir`; nothing is built until `fit()`."""
        for key in ("max_epochs", "batch_size", "grad_accum"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"trainer.{key}={getattr(cfg, key)} must be >= 1")
        self.task, self.cfg, self.optim_cfg = task, cfg, optim
        self.run_dir = Path(run_dir)
        self.device_spec, self.precision, self.seed, self.resume = device, precision, seed, resume
        self.mps_fallback = mps_fallback
        self.compile_cfg, self.model_hook = compile_cfg, model_hook
        self.model: nn.Module | None = None
        self.plan: DevicePlan | None = None

    # ---- set-up -------------------------------------------------------------------------------------
    def _loader(self, ds: Dataset, sampler: ResumableBatchSampler, train: bool, epoch: int) -> DataLoader:
        workers = self.cfg.num_workers
        if workers < 0:
            workers = self.plan.num_workers if self.task.loader_workers is None else self.task.loader_workers
        return DataLoader(
            _SeededSamples(ds) if train else ds,
            batch_sampler=_SeededBatches(sampler, self.seed, epoch) if train else sampler,
            collate_fn=self.task.collate_fn(),
            num_workers=workers,
            pin_memory=self.plan.pin_memory,
            # worker seeds derive from this generator, so they depend on (seed, epoch) only
            generator=torch.Generator().manual_seed(self.seed * 7919 + epoch),
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        return self.plan.autocast()

    def _to_device(self, batch: Any) -> Any:
        dev, nb = self.plan.device, self.plan.pin_memory
        if isinstance(batch, torch.Tensor):
            return batch.to(dev, non_blocking=nb)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        """Run the task's evaluation over `loader` in eval mode; keys come back prefixed with `val/`."""
        model.eval()

        def batches() -> Iterator[Any]:
            for b in loader:
                yield self.task.on_device(model, self._to_device(b))

        with torch.no_grad(), self._autocast():
            out = self.task.evaluate(model, batches())
        model.train()
        return {f"val/{k}": float(v) for k, v in out.items()}

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to `max_epochs`/`max_steps`; return the final metrics (last evaluation and best)."""
        cfg, task = self.cfg, self.task
        seed_everything(self.seed)
        self.plan = plan = resolve(self.device_spec, self.precision, mps_fallback=self.mps_fallback)
        plan.apply()
        print(f"device plan: {plan.summary()}", flush=True)
        for w in plan.warnings:
            print(f"warning: {w}", flush=True)

        model = task.build_model().to(plan.device)
        train_ds, val_ds = task.build_datasets()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        task.save_artifacts(self.run_dir)
        train_sampler = task.batch_sampler(train_ds, cfg.batch_size, train=True, seed=self.seed)
        val_bs = cfg.eval_batch_size or cfg.batch_size * 2
        val_loader = self._loader(
            val_ds, task.batch_sampler(val_ds, val_bs, train=False, seed=self.seed), False, 0
        )
        steps_per_epoch = math.ceil(len(train_sampler.batches(0)) / cfg.grad_accum)
        if steps_per_epoch == 0:
            raise ConfigError("the training set is empty; check data= and its paths")
        total_steps = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.max_epochs

        opt = build_optimizer(model, self.optim_cfg, plan.optimizer_impl)
        sched = build_scheduler(opt, self.optim_cfg, total_steps)
        scaler = plan.make_grad_scaler()
        step, epoch, start_batch, best = 0, 0, 0, None
        last_eval: dict[str, float] = {}

        ckpt_path = checkpoint.resolve(self.resume, self.run_dir) if self.resume else None
        if ckpt_path is not None:
            weights, st, meta = checkpoint.load(ckpt_path)
            checkpoint.load_model_state(model, weights, ckpt_path)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            scaler.load_state_dict(st["scaler"])
            set_rng_state(st["rng"])
            step, epoch, start_batch = st["step"], st["epoch"], st["batch_in_epoch"]
            best, last_eval = meta.get("best"), meta.get("metrics", {})
            print(f"resumed from {ckpt_path} (step {step}, epoch {epoch}, batch {start_batch})", flush=True)

        model_hook, compiled = self.model_hook, False
        if self.compile_cfg is not None and self.compile_cfg.policy != "off":
            from core import compile as kc

            if ckpt_path is not None:
                kc.load_artifacts(ckpt_path / "compile_artifacts.bin", self.compile_cfg)
            backend = plan.compile_backend
            if backend is None:
                print(f"compile: eager ({plan.reasons.get('compile', 'no backend here')})", flush=True)
            else:
                # one batch size for the compiled graphs (the probe included): each short last batch is
                # topped up rather than compiled for, or marked dynamic at a cost on every step
                train_sampler.set_fill_last(True)

                def model_hook(m: nn.Module, probe: Callable[[nn.Module], None]) -> nn.Module:
                    out = kc.apply(
                        m, self.compile_cfg, probe=probe, backend=backend, planned_steps=total_steps - step
                    )
                    print(f"compile: {out.compile_report.reason}", flush=True)
                    return out

        if model_hook is not None:
            probe_batch = next(iter(self._loader(train_ds, train_sampler, True, epoch)))

            def probe(m: nn.Module) -> None:
                with self._autocast():
                    out = task.step(m, task.on_device(m, self._to_device(probe_batch)))
                out.loss.backward()

            # probing must not consume RNG, or a resumed run would diverge from an uninterrupted one
            with torch.random.fork_rng(devices=[plan.device] if plan.device.type == "cuda" else []):
                model = model_hook(model, probe)
            compiled = is_compiled(model)
            if not compiled:
                train_sampler.set_fill_last(False)  # eager runs keep the plain epoch
            opt.zero_grad(set_to_none=True)
        self.model = model
        raw_model = getattr(model, "_orig_mod", model)

        bar_write, tqdm = print, None
        if cfg.progress:
            with contextlib.suppress(ImportError):
                from tqdm.auto import tqdm

                bar_write = tqdm.write
        logger = MetricsLogger(self.run_dir, tensorboard=cfg.tensorboard, echo=bar_write)

        def save(next_epoch: int, next_batch: int) -> None:
            train_state = {
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": rng_state(),
                "step": step,
                "epoch": next_epoch,
                "batch_in_epoch": next_batch,
            }
            meta = {"epoch": next_epoch, "metrics": last_eval, "best": best, "task": type(task).__name__}
            path = checkpoint.save(
                self.run_dir / "checkpoints",
                step,
                model=raw_model.state_dict(),
                train=train_state,
                meta=meta,
                keep_last=cfg.keep_last,
            )
            if compiled:  # lets a resumed run start with a warm compile cache
                kc.save_artifacts(path / "compile_artifacts.bin", self.compile_cfg)

        def run_eval() -> None:
            nonlocal last_eval, best
            last_eval = self.evaluate(model, val_loader)
            key = task.primary_metric
            if key in last_eval:
                v = last_eval[key]
                if best is None or (v > best if task.maximize else v < best):
                    best = v
                last_eval[f"best/{key}"] = best
            logger.log(step, last_eval, epoch=epoch)

        model.train()
        t_start = time.perf_counter()
        done = step >= total_steps
        while not done and epoch < cfg.max_epochs:
            train_sampler.set_epoch(epoch, start_batch)
            n_batches = len(train_sampler.batches(epoch))
            loader = self._loader(train_ds, train_sampler, True, epoch)
            bar = None
            if tqdm is not None:
                bar = tqdm(
                    total=n_batches,
                    initial=start_batch,
                    desc=f"epoch {epoch + 1}/{cfg.max_epochs}",
                    mininterval=1.0,
                    dynamic_ncols=True,
                    leave=False,
                )
            seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
            i = start_batch - 1
            for i, batch in enumerate(loader, start=start_batch):
                group_start = (i // cfg.grad_accum) * cfg.grad_accum
                group_len = min(cfg.grad_accum, n_batches - group_start)
                batch = task.on_device(model, self._to_device(batch))
                with self._autocast():
                    out = task.step(model, batch)
                scaler.scale(out.loss / group_len).backward()
                seen += out.count
                loss_sum += float(out.loss.detach()) * out.count
                if bar is not None:
                    bar.update(1)
                if i + 1 < group_start + group_len:
                    continue
                # optimizer step boundary
                grad_norm = None
                if cfg.grad_clip > 0:
                    scaler.unscale_(opt)
                    grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                if step % cfg.log_every == 0 or step == total_steps:
                    rate = seen / max(time.perf_counter() - t0, 1e-9)
                    row = {
                        "train/loss": loss_sum / max(seen, 1),
                        "train/lr": sched.get_last_lr()[0],
                        "train/samples_per_s": rate,
                    }
                    if grad_norm is not None:
                        row["train/grad_norm"] = grad_norm
                    if bar is not None:
                        bar.set_postfix(loss=f"{row['train/loss']:.4f}", sps=f"{rate:.0f}")
                    if compiled:
                        row.update(kc.compile_metrics())
                    logger.log(step, row, epoch=epoch)
                    seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
                done = step >= total_steps
                if cfg.eval_every and step % cfg.eval_every == 0 and not done:
                    run_eval()
                if cfg.ckpt_every and step % cfg.ckpt_every == 0 and not done and i + 1 < n_batches:
                    save(epoch, i + 1)
                if done:
                    break
            if bar is not None:
                bar.close()
            epoch, start_batch = epoch + 1, 0
            if done and i + 1 < n_batches:  # stopped by max_steps mid-epoch: resume continues there
                epoch, start_batch = epoch - 1, i + 1
            run_eval()
            save(epoch, start_batch)
        logger.close()
        wall = time.perf_counter() - t_start
        return {**last_eval, "step": float(step), "epoch": float(epoch), "train/wall_s": wall}


class _SeededSamples(Dataset):
    """Runs each sample's random transforms under a seed fixed by (run seed, epoch, index)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        idx, seed = key
        # only the CPU generator: augmentation runs on CPU, and CUDA RNG (dropout) must stay untouched
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            return self.ds[idx]


class _SeededBatches:
    """Pairs each index from a resumable batch sampler with its per-sample seed."""

    def __init__(self, sampler: ResumableBatchSampler, seed: int, epoch: int) -> None:
        self.sampler, self.base = sampler, (seed * 1_000_003 + epoch) * 1_000_003

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.sampler:
            yield [(i, (self.base + i) % 2**63) for i in batch]

    def __len__(self) -> int:
        return len(self.sampler)
