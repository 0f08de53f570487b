"""`python -m recipes.generate ckpt=RUN_DIR prompt="..."`: sample text from a trained language model.

RUN_DIR is a `+task=lm` run directory (or one of its `checkpoints/step_*` folders). The task is rebuilt from
the run's saved config (`.hydra/config.yaml`), so the tokenizer is the one the model was trained with; the
weights come from the checkpoint folder when one is given, else the exported `model.safetensors`, else the
newest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import text  # noqa: F401  (registers the lm task the saved config names)
from core import checkpoint
from core.device import resolve
from core.errors import CheckpointError, ConfigError, TorchkilnError
from recipes.tasks import build_task, load_run_config

USAGE = 'usage: python -m recipes.generate ckpt=RUN_DIR prompt="..." [max_new_tokens=200 temperature=0.8 ...]'


@dataclass
class GenerateConfig:
    """Command-line options (key=value)."""

    ckpt: str = ""
    prompt: str = ""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0  # 0 = sample from the whole distribution
    seed: int = 0
    device: str = "auto"


def parse_args(argv: list[str]) -> GenerateConfig:
    """key=value arguments into a GenerateConfig; an unknown key or bad value is a one-line ConfigError."""
    cfg = GenerateConfig()
    types = {f.name: f.type for f in dataclasses.fields(GenerateConfig)}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"argument {arg!r} is not key=value; {USAGE}")
        if key not in types:
            raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(types)}")
        # Parsed by hand, not as YAML: a prompt like "1:1" or "yes" must stay the text it is.
        kind = {"int": int, "float": float}.get(types[key], str)
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not a valid {types[key]}") from None
    if not cfg.ckpt:
        raise ConfigError(f"ckpt= is required; {USAGE}")
    return cfg


def locate(ckpt: str) -> tuple[Path, Path | None]:
    """(run dir, checkpoint folder or None) for `ckpt`, a run dir or a `checkpoints/step_*` folder."""
    path = Path(ckpt).expanduser()
    if (path / "meta.json").is_file():
        return path.parent.parent, path
    if not (path / ".hydra" / "config.yaml").is_file():
        raise CheckpointError(f"ckpt={ckpt}: no .hydra/config.yaml there; give a training run directory")
    return path, None


def load_task_and_model(run_dir: Path, step_dir: Path | None, device: str) -> tuple[object, object]:
    """Rebuild the run's task and model from its saved config and load the trained weights."""
    cfg = load_run_config(run_dir / ".hydra" / "config.yaml")
    name = cfg["task"]["name"]
    task = build_task(cfg)
    if not hasattr(task, "generate"):
        raise ConfigError(
            f"ckpt={run_dir} is a '{name}' run; only language-model runs (+task=lm) generate text"
        )
    model = task.build_model()
    exported = run_dir / "model.safetensors"
    if step_dir is None and exported.is_file():
        from safetensors.torch import load_model

        try:
            load_model(model, str(exported))
        except RuntimeError as e:
            raise CheckpointError(f"{exported} does not match the model of its run's config: {e}") from None
    else:
        step_dir = step_dir or checkpoint.resolve("auto", run_dir)
        if step_dir is None:
            raise CheckpointError(f"ckpt={run_dir}: no model.safetensors and no complete checkpoint in it")
        weights, _, _ = checkpoint.load(step_dir)
        checkpoint.load_model_state(model, weights, step_dir)
    return task, model.to(resolve(device, measure=False).device).eval()


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the prompt followed by the sampled continuation."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        cfg = parse_args(argv)
        run_dir, step_dir = locate(cfg.ckpt)
        task, model = load_task_and_model(run_dir, step_dir, cfg.device)
        text = task.generate(
            model,
            cfg.prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k or None,
            seed=cfg.seed,
        )
    except TorchkilnError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
