"""`python -m recipes.generate ckpt=RUN_DIR prompt="..."`: sample text from a trained language model.

RUN_DIR is a `+task=lm` run directory (or one of its `checkpoints/step_*` folders). The task is rebuilt from
the run's saved config (`.hydra/config.yaml`), so the tokenizer is the one the model was trained with; the
weights come from the checkpoint folder when one is given, else the exported `model.safetensors`, else the
newest complete checkpoint.

Sampling: temperature=0 is greedy; top_k=K and top_p=P limit the draw to the K likeliest tokens and to the
fewest likeliest holding mass P. stop=TEXT (repeatable, or a JSON list: stop='["\\n\\n", "."]') ends the
output before the first stop string the continuation contains; in a plain value \\n, \\t and \\\\ are a
newline, a tab and a backslash. overflow_keep=N: tokens kept when the context is full (0: half of it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field

from core.errors import ConfigError, TorchkilnError
from recipes.runs import load_run
from text.sampling import check_sampling

USAGE = (
    'usage: python -m recipes.generate ckpt=RUN_DIR prompt="..." '
    "[max_new_tokens=200 temperature=0.8 top_k=0 top_p=1 stop=TEXT seed=0 ...]"
)


@dataclass
class GenerateConfig:
    """Command-line options (key=value)."""

    ckpt: str = ""
    prompt: str = ""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0  # 0 = sample from the whole distribution
    top_p: float = 1.0  # 1 = sample from the whole distribution
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    overflow_keep: int = 0  # 0 = the model's default (half its context)
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
        if key == "stop":
            cfg.stop.extend(_stop_strings(value))
            continue
        # Parsed by hand, not as YAML: a prompt like "1:1" or "yes" must stay the text it is.
        kind = {"int": int, "float": float}.get(types[key], str)
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not a valid {types[key]}") from None
    if not cfg.ckpt:
        raise ConfigError(f"ckpt= is required; {USAGE}")
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    if cfg.overflow_keep < 0:
        raise ConfigError(f"overflow_keep={cfg.overflow_keep} must be >= 0 (0: half the context)")
    if "" in cfg.stop:
        raise ConfigError("stop= needs a non-empty string")
    return cfg


def _stop_strings(value: str) -> list[str]:
    """A JSON list of strings as its items; else the value itself, with \\n, \\t and \\\\ unescaped."""
    if value.startswith("[") and value.endswith("]"):
        try:
            items = json.loads(value)
        except ValueError:
            items = None
        if isinstance(items, list) and all(isinstance(i, str) for i in items):
            return items
    return [re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), value)]


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
            top_p=cfg.top_p,
            stop=cfg.stop,
            seed=cfg.seed,
            overflow_keep=cfg.overflow_keep or None,
        )
    except TorchkilnError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
