"""Train the toy task with the Trainer, in one process or under torchrun, for the parity tests.

`python tests/core/dist_fit.py OUT PARALLEL [key=value ...]` (or the same under `torchrun`): OUT gets the
run (metrics.jsonl, checkpoints) and, from rank 0, `weights.pt` with the full gathered parameters (and
`ema.pt`, the EMA's, with trainer.ema_decay set). With `hook=halve`, a `model_hook` halves the initial
weights, probes one step and writes OUT/hook_rank{R}.txt; with `evals=b`, trainer.evals scores the task's
benchmark `b` (OUT/evals_rank{R}.txt lists its calls).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from core.compile import CompileConfig  # noqa: E402
from core.distributed import dist_env, group  # noqa: E402
from core.loop.trainer import Trainer, TrainerConfig  # noqa: E402
from core.optim import OptimConfig  # noqa: E402
from tests.core.toy_task import ToyTask  # noqa: E402


class DyingToyTask(ToyTask):
    """The toy task, whose rank `TORCHKILN_TEST_KILL_RANK` SIGKILLs itself at its Nth step call
    (`TORCHKILN_TEST_KILL_AT`) once: the marker file `TORCHKILN_TEST_KILL_MARK` records that it did."""

    calls = 0

    def step(self, model, batch):  # noqa: ANN001, ANN201
        """Score the batch, or die once at the chosen call."""
        DyingToyTask.calls += 1
        mark = Path(os.environ.get("TORCHKILN_TEST_KILL_MARK", "/nonexistent/none"))
        if (
            DyingToyTask.calls == int(os.environ.get("TORCHKILN_TEST_KILL_AT", "0"))
            and dist_env().rank == int(os.environ.get("TORCHKILN_TEST_KILL_RANK", "-1"))
            and not mark.exists()
        ):
            mark.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(model, batch)

    def benchmarks(self, names, limit):  # noqa: ANN001, ANN201
        """trainer.evals (with `evals=b`): the model's first weight; each call leaves a line, the model's
        class, in OUT/evals_rank{R}.txt (OUT: `TORCHKILN_TEST_OUT`)."""

        def run(model: torch.nn.Module, plan) -> dict[str, float]:  # noqa: ANN001
            out = Path(os.environ["TORCHKILN_TEST_OUT"]) / f"evals_rank{dist_env().rank}.txt"
            with out.open("a") as f:
                f.write(type(model).__name__ + "\n")
            return {f"eval/{n}/weight": float(next(model.parameters()).flatten()[0]) for n in names}

        return run


def main() -> None:
    """Fit, then write the full weights from rank 0."""
    out, parallel, *pairs = sys.argv[1:]
    named = ("compile=", "hook=", "evals=")
    extra = {
        k: float(v) if "." in v else int(v)
        for k, v in (p.split("=") for p in pairs if not p.startswith(named))
    }
    policy = next((p.split("=")[1] for p in pairs if p.startswith("compile=")), None)
    hook = halve_weights(Path(out)) if "hook=halve" in pairs else None
    cfg = TrainerConfig(
        **{
            "max_epochs": 100,
            "max_steps": 20,
            "batch_size": 8,
            "log_every": 1,
            "progress": False,
            "ckpt_every": 10,
            "keep_last": 10,
            "parallel": parallel,
            "evals": [p.split("=")[1] for p in pairs if p.startswith("evals=")],
            **extra,
        }
    )
    os.environ["TORCHKILN_TEST_OUT"] = out
    resume = "auto" if (Path(out) / "checkpoints").is_dir() else None
    t = Trainer(
        DyingToyTask(jitter=0.0, dropout=0.0),
        cfg,
        OptimConfig(lr=1e-2, warmup_steps=2),
        run_dir=out,
        device="cpu",
        precision="fp32",
        seed=3,
        resume=resume,
        compile_cfg=None if policy is None else CompileConfig(policy=policy),
        model_hook=hook,
    )
    t.fit()
    save_weights(t, Path(out))
    if t.ema is not None:
        from core.loop.ema import averaged_state

        state = averaged_state(
            t.ema, t.model, t.dist
        )  # a collective under several ranks: each gives its shards of the average
        if dist_env().is_main:
            torch.save(state, Path(out) / "ema.pt")
    leave()


def halve_weights(out: Path):  # noqa: ANN201
    """A `model_hook` that halves every initial weight, runs the probe and leaves a file for its rank."""

    def hook(model: torch.nn.Module, probe) -> torch.nn.Module:  # noqa: ANN001
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        probe(model)  # a real step on this rank's batch: its gradients must not reach the first update
        (out / f"hook_rank{dist_env().rank}.txt").write_text(type(model).__name__)
        return model

    return hook


def save_weights(t: Trainer, out: Path) -> None:
    """Rank 0 (or the one process) writes the trained model's full weights to `out/weights.pt`."""
    if dist_env().distributed:
        from core.checkpoint import full_model_state

        state = full_model_state(t.model)  # a collective: every rank gives its shards
    else:
        state = t.model.state_dict()
    if dist_env().is_main:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "weights.pt")


def leave() -> None:
    """Under several ranks: meet them, leave the group, then skip the interpreter's teardown."""
    if dist_env().distributed:
        group.stop()
        group.exit_process(0)


if __name__ == "__main__":
    main()
