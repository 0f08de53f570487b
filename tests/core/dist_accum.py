"""One float64 SGD run of the masked toy task (unequal micro-batches, ignored targets) for the accumulation
tests, in one process or under torchrun, counting the gradient collectives of each optimizer step.

`python tests/core/dist_accum.py OUT PARALLEL SIZES GRAD_ACCUM STEPS IGNORE_EVERY SYNC`: SIZES the global
micro-batches' example counts ("6,14"), SYNC `group` (the loop's: gradients reduced once a group) or
`always` (every micro-batch reduces, as before). OUT gets `weights.pt` (the full parameters) and
`collectives.json` (per optimizer step, the gradient reductions rank 0 issued) from rank 0.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import core.loop.trainer  # noqa: E402
from core.distributed import dist_env  # noqa: E402
from core.loop.callbacks import Callback  # noqa: E402
from core.loop.trainer import Trainer, TrainerConfig  # noqa: E402
from core.optim import OptimConfig  # noqa: E402
from tests.core.dist_fit import leave, save_weights  # noqa: E402
from tests.core.toy_task import MaskedToyTask  # noqa: E402


class CountGradientCollectives(Callback):
    """Counts DDP's bucket all-reduces (a comm hook) or FSDP2's reduce-scatters, per optimizer step."""

    def __init__(self) -> None:
        self.calls, self.per_step = 0, []

    def on_fit_start(self, trainer: Trainer) -> None:
        """Install the counter on the wrapped model, before its first backward."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.model
        if isinstance(model, DistributedDataParallel):
            # unannotated: DDP refuses a hook whose annotations are not its own classes (here, strings)
            def hook(state, bucket):  # noqa: ANN001, ANN202
                self.calls += 1
                return allreduce_hook(state, bucket)

            model.register_comm_hook(model.process_group, hook)
        elif dist.is_initialized():  # FSDP2 calls it through the module, once per sharded group
            real = dist.reduce_scatter_single

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return real(*args, **kwargs)

            dist.reduce_scatter_single = counted

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Close the step's count."""
        self.per_step.append(self.calls)
        self.calls = 0


def main() -> None:
    """Fit, then write the full weights and the counts from rank 0."""
    out, parallel, sizes, accum, steps, ignore_every, sync = sys.argv[1:]
    if sync == "always":  # the loop as it was: no micro-batch skips the reduction
        core.loop.trainer.gradient_sync = lambda model, enabled: contextlib.nullcontext()
    counter = CountGradientCollectives()
    cfg = TrainerConfig(
        max_epochs=1,
        max_steps=int(steps),
        batch_size=8,
        grad_accum=int(accum),
        grad_clip=0.0,
        log_every=1,
        progress=False,
        parallel=parallel,
    )
    task = MaskedToyTask(tuple(int(s) for s in sizes.split(",")), int(ignore_every))
    optim = OptimConfig(
        name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, warmup_ratio=0.0, schedule="constant"
    )
    t = Trainer(task, cfg, optim, run_dir=out, device="cpu", precision="fp32", seed=3, callbacks=[counter])
    t.fit()
    save_weights(t, Path(out))
    if dist_env().is_main:
        (Path(out) / "collectives.json").write_text(json.dumps(counter.per_step))
    leave()


if __name__ == "__main__":
    main()
