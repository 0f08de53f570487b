"""Non-finite steps: a step whose loss (or clipped gradient norm) is not finite is skipped, no update, and
counted; `trainer.nonfinite=skip` stops the run after `trainer.max_nonfinite` in a row, `abort` at the first,
with one line naming the step, its samples and the newest checkpoint whose weights are finite. A run that
ends with non-finite weights or monitored metric (too few steps left for the limit: #41's 2-step run at
optim.lr=1e30 exported NaN weights and exited 0) stops the same way before anything is exported."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from core import checkpoint
from core.data.samplers import ResumableBatchSampler
from core.distributed import group as dgroup
from core.errors import TrainingError
from core.loop.config import TrainerConfig


class NonfiniteSteps:
    """The count of skipped steps, in a row and in all, and the policy that stops the run."""

    def __init__(self, cfg: TrainerConfig) -> None:
        """Count under `cfg.nonfinite` and `cfg.max_nonfinite`."""
        self.cfg = cfg
        self.in_a_row = self.total = 0

    def finite(self) -> None:
        """A step updated the weights: the run of skipped steps ends."""
        self.in_a_row = 0

    def skipped(
        self, step: int, batches: tuple[int, int, int], sampler: ResumableBatchSampler, run_dir: Path
    ) -> None:
        """Count skipped step `step` (its `batches` = epoch, first, end); past the policy's limit, stop with
        the step, its samples and the newest checkpoint with finite weights (a TrainingError, exit 3)."""
        self.in_a_row += 1
        self.total += 1
        cfg = self.cfg
        if cfg.nonfinite == "skip" and self.in_a_row < cfg.max_nonfinite:
            return
        epoch, first, end = batches
        samples = [j for b in sampler.batches(epoch)[first:end] for j in b]
        shown = ", ".join(map(str, samples[:8])) + (", ..." if len(samples) > 8 else "")
        good = checkpoint.newest_with_finite_weights(run_dir / "checkpoints")
        raise TrainingError(
            f"non-finite loss or gradients at step {step} (epoch {epoch}, batches {first}-{end - 1}, "
            f"samples {shown}), {self.in_a_row} step(s) in a row (trainer.nonfinite={cfg.nonfinite}, "
            f"trainer.max_nonfinite={cfg.max_nonfinite}); newest checkpoint with finite weights: "
            f"{good or 'none'}; lower optim.lr, set trainer.grad_clip, or check these samples",
            key="samples",
            value=shown,
        )

    def check_end(
        self, model: nn.Module, metrics: dict[str, float], monitor: str, lr: float, run_dir: Path
    ) -> None:
        """At the end of a run, before its weights are exported: non-finite weights (on any rank), or a
        non-finite `monitor` or validation figure in `metrics`, stop it (a TrainingError, exit 3) naming the
        step and optim.lr."""
        local = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        weights_ok = not dgroup.any_rank(not local, device)
        # the monitored metric and every validation figure: weights of ~1e30 are finite, yet their val/loss
        # is NaN (a 2-step run at optim.lr=1e30), and accuracy still reads as a number
        bad = [
            k
            for k, v in metrics.items()
            if (k == monitor or k.startswith("val/")) and isinstance(v, float) and not math.isfinite(v)
        ]
        if weights_ok and not bad:
            return
        what = "weights" if not weights_ok else ", ".join(f"{k} ({metrics[k]})" for k in bad)
        good = checkpoint.newest_with_finite_weights(run_dir / "checkpoints")
        raise TrainingError(
            f"the run ended at step {int(metrics.get('step', 0))} with non-finite {what}: it diverged, and "
            f"nothing was exported; newest checkpoint with finite weights: {good or 'none'}; lower optim.lr "
            f"({lr:g}) or set trainer.grad_clip",
            key="optim.lr",
            value=f"{lr:g}",
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own elements on this rank (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t
