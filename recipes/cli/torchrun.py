"""The training command under torchrun: a job of `dist.nproc_per_node` > 1 processes becomes torchrun's
agent (its workers run the job's overrides in the job's directory), the ranks agree on one run directory
before Hydra makes one each, and a rank leaves its process group and ends without the interpreter's teardown
once the job is done (core.distributed.group.exit_process)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.distributed import dist_env
from core.distributed import group as dgroup
from core.distributed.launch import launched, run_agent
from core.files import write_text_atomic
from recipes.cli.config import CONF_DIR


def starts_agent(cfg: DictConfig) -> bool:
    """Whether this job starts torchrun's agent: several processes asked, and this is not one of them."""
    return cfg.dist.nproc_per_node > 1 and not launched() and not cfg.trainer.dry_run


def run_workers(cfg: DictConfig) -> tuple[int, dict[str, float]]:
    """Run this job's overrides in torchrun's workers, in this job's run directory; (the group's exit code,
    the final metrics its rank 0 wrote: empty if none)."""
    hc = HydraConfig.get()
    job = [o for o in hc.overrides.task if not o.startswith("hydra.run.dir=")]
    code = run_agent("recipes.train", [*job, f"hydra.run.dir={hc.runtime.output_dir}"], cfg.dist)
    return code, {} if code else workers_metrics(Path(hc.runtime.output_dir))


def workers_metrics(run_dir: Path) -> dict[str, float]:
    """The final metrics a torchrun job's rank 0 wrote into result.json; empty if it wrote none."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return dict(json.loads((run_dir / "result.json").read_text())["metrics"])
    return {}


def agreed_run_dir(overrides: list[str]) -> list[str]:
    """Under torchrun, `overrides` plus the one run directory every rank writes to: rank 0 resolves
    `hydra.run.dir` (its `${now:...}`) and broadcasts it, and keeps it in a pointer file beside it named by
    torchrun's run id, so ranks restarted after a failure (same run id) return to the same directory."""
    env = dist_env()
    if not (launched() and env.distributed) or any(o.startswith("hydra.run.dir=") for o in overrides):
        return overrides
    from core.device import detect

    dgroup.start("cuda" if detect().cuda else "cpu", env)
    decided = None
    if env.is_main:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            fresh = Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
        GlobalHydra.instance().clear()
        pointer = fresh.parent / f".torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
        if pointer.is_file():
            decided = pointer.read_text().strip()
        else:
            decided = str(fresh)
            pointer.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(pointer, decided)
    decided = dgroup.broadcast_object(decided)
    return [*overrides, f"hydra.run.dir={decided}"]


@contextlib.contextmanager
def group_exit() -> Iterator[None]:
    """Around the Hydra job: leave the process group (at once on an error, else after meeting every rank)
    and, under torchrun, end the process with the job's exit code."""
    try:
        yield
    except SystemExit as e:  # Hydra's and our one-line errors end here with their exit code
        dgroup.stop(wait=False)
        if dist_env().distributed and launched():
            dgroup.exit_process(e.code if isinstance(e.code, int) else 1)
        raise
    if dist_env().distributed and launched():
        dgroup.stop()
        dgroup.exit_process(0)
