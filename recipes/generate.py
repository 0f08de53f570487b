"""`python -m recipes.generate ckpt=RUN_DIR prompt="..."`: sample text from a trained language model.

RUN_DIR is a `+task=lm` run directory (or one of its `checkpoints/step_*` folders; a `+task=sft` or
`+task=dpo` run's answers the prompt as one user message in its chat template, printing the reply), or a
Hugging Face Llama/Qwen2/Qwen3 folder (config.json, safetensors, tokenizer.json:
`recipes.cli.runs.hf_run_config`; with `chat=true`, answered in the folder's chat template as an sft run's).
This is `recipes.predict` for one prompt given on the command line: the same run loading (the tokenizer the
model was trained with, the weights of the checkpoint folder given, else the exported `model.safetensors`,
else the newest complete checkpoint) and the same sampling options (`text.lm.LanguageModeling.predict`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError
from core.registry import TASKS
from recipes.cli import options
from recipes.cli.command import command
from recipes.cli.options import check, fields_of, help_text, require
from recipes.cli.runs import is_hf_folder, load_run
from recipes.predict import predict_items

USAGE = (
    'usage: python -m recipes.generate ckpt=RUN_DIR prompt="..." '
    "[max_new_tokens=200 temperature=0.8 top_k=0 top_p=1 stop=TEXT seed=0 ...]"
)


@dataclass
class GenerateOptions:
    """The command's own keys."""

    #: the lm run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: the text to continue (empty: the start of a document)
    prompt: str = ""
    #: cpu, cuda, cuda:N, mps or auto; empty: the run's own device setting
    device: str = ""
    #: fp32, bf16, fp16 or auto; empty: the run's own precision setting (an HF folder's: auto)
    precision: str = ""
    #: an HF folder: ask the prompt as one user message in its chat template (ChatML without one) and print
    #: the reply alone, as for a +task=sft run; false: continue the prompt
    chat: bool = False


def sampling() -> Any:
    """The lm task's prediction method, whose keyword options (max_new_tokens, ...) are this command's too."""
    return TASKS.get("lm").predict


def parse_args(argv: list[str]) -> dict[str, Any]:
    """key=value arguments as {key: value} (defaults filled in); an unknown key or bad value is a one-line
    ConfigError."""
    values, _ = options.parse_args(argv, {**fields_of(GenerateOptions), **fields_of(sampling())}, usage=USAGE)
    check(values, GenerateOptions)
    check(values, sampling())
    require(values, ("ckpt",), USAGE)
    return values


def run(argv: list[str]) -> int:
    """The command: print the prompt followed by the sampled continuation."""
    values = parse_args(argv)
    hf = is_hf_folder(values["ckpt"])
    if values["chat"] and not hf:
        # a run answers in its own way: an sft run always as a chat, an lm run never learned a template
        raise ConfigError(
            "chat=true is for a Hugging Face folder; a +task=sft run replies as a chat already, an lm run "
            "continues its prompt",
            key="chat",
            value="true",
        )
    loaded = load_run(
        values["ckpt"],
        device=values["device"],
        precision=values["precision"],
        tasks=("lm", "sft", "dpo", "grpo", "distill"),
        command="recipes.generate",
        hf_task="sft" if values["chat"] else "lm",
    )
    rows = predict_items(loaded, [values["prompt"]], batch_size=1, options=check(values, sampling()))
    print(rows[0]["text"], flush=True)
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", GenerateOptions), ("sampling", sampling())])


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
