"""`python -m recipes.generate ckpt=RUN_DIR prompt="..."`: sample text from a trained language model.

RUN_DIR is a `+task=lm` run directory (or one of its `checkpoints/step_*` folders). The task is rebuilt from
the run's saved config (`.hydra/config.yaml`), so the tokenizer is the one the model was trained with; the
weights come from the checkpoint folder when one is given, else the exported `model.safetensors`, else the
newest complete checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from core.errors import ConfigError, TorchkilnError
from recipes.arguments import parse_key_values
from recipes.runs import load_run

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
    cfg = parse_key_values(argv, GenerateConfig, USAGE)
    if not cfg.ckpt:
        raise ConfigError(f"ckpt= is required; {USAGE}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the prompt followed by the sampled continuation."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        cfg = parse_args(argv)
        run = load_run(cfg.ckpt, device=cfg.device, tasks=("lm",), command="recipes.generate")
        task, model = run.task, run.model
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
