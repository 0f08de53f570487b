"""A training run's weights file, written (`save_weights`: train, export), and the run loaded back for what
comes after training (generate, transcribe, eval, predict, export).

`ckpt=` names a run directory (its exported `model.safetensors`: the best checkpoint's weights by default;
else its newest complete checkpoint) or one `checkpoints/step_*` folder. The task is rebuilt from the run's
saved `.hydra/config.yaml` (plain values only: `recipes.tasks.load_run_config`), so tokenizers, word lists and
model settings are the ones the model was trained with; weights load with `weights_only=True` or safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

import audio  # noqa: F401  (registers the tasks a saved config may name)
import text  # noqa: F401
import vision  # noqa: F401
from core import checkpoint
from core.device import resolve
from core.errors import CheckpointError, ConfigError
from core.task import Task
from recipes.tasks import build_task, load_run_config


@dataclass
class Run:
    """A loaded run: where it is, its saved config, its task and its model with the trained weights."""

    run_dir: Path
    cfg: dict[str, Any]
    task: Task
    model: nn.Module
    #: the file or checkpoint folder the weights came from
    weights: Path


def save_weights(model: nn.Module, path: Path) -> None:
    """Write `model`'s weights to `path` (safetensors); tied weights are stored once."""
    from safetensors.torch import save_model

    save_model(model, str(path))


def save_state(state: dict[str, Any], path: Path) -> None:
    """Write a full state dict to `path` (safetensors); tied weights (one tensor under two names) get a copy
    each, as safetensors refuses shared storage."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    whole = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        whole[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
        seen.add(ptr)
    save_file(whole, str(path))


def locate(ckpt: str | Path) -> tuple[Path, Path | None]:
    """(run dir, checkpoint folder or None) for `ckpt`, a run dir or a `checkpoints/step_*` folder."""
    path = Path(ckpt).expanduser()
    if (path / "meta.json").is_file():
        return path.parent.parent, path
    if not (path / ".hydra" / "config.yaml").is_file():
        raise CheckpointError(
            f"ckpt={ckpt}: no .hydra/config.yaml there; give a training run directory (its config and "
            "model.safetensors or checkpoints/) or one of its checkpoints/step_* folders"
        )
    return path, None


def load_run(ckpt: str | Path, *, device: str = "cpu", tasks: tuple[str, ...] = (), command: str = "") -> Run:
    """Load the run `ckpt` names onto `device` in eval mode; `tasks` (if given) are the task names the calling
    `command` serves, anything else is a one-line ConfigError naming the run's task."""
    run_dir, step_dir = locate(ckpt)
    cfg = load_run_config(run_dir / ".hydra" / "config.yaml")
    name = cfg["task"]["name"]
    if tasks and name not in tasks:
        raise ConfigError(
            f"ckpt={ckpt} is a '{name}' run; {command or 'this command'} serves {', '.join(tasks)} runs"
        )
    task = build_task(cfg)
    task.load_artifacts(run_dir)
    model = task.build_model()
    exported = run_dir / "model.safetensors"
    if step_dir is None and exported.is_file():
        from safetensors.torch import load_model

        try:
            load_model(model, str(exported))
        except (RuntimeError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{exported} does not match the model of its run's config: {first}"
            ) from None
        source = exported
    else:
        source = step_dir or checkpoint.resolve("auto", run_dir)
        if source is None:
            raise CheckpointError(f"ckpt={ckpt}: no model.safetensors and no complete checkpoint in it")
        weights, _, _ = checkpoint.load(source)
        checkpoint.load_model_state(model, weights, source)
    model = model.to(resolve(device, measure=False).device).eval()
    return Run(run_dir, cfg, task, model, source)
