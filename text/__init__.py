"""torchkiln text: the embedded KJV corpus, tokenizers, GPT, Llama-style and encoder models, LM, chat
fine-tuning, preference tuning, distillation and classification tasks.

Importing the package registers its datasets, models and tasks in core.registry, and the models'
tensor-parallel plans with core.distributed.
"""

from text import (
    chat,
    classification,
    datasets,
    distill,
    dpo,
    gpt,
    grpo,
    llama,
    lm,
    models,
    parallelize,
    preference,
    pretrained,
    prompts,
    sft,
)

__all__ = [
    "chat",
    "classification",
    "datasets",
    "distill",
    "dpo",
    "gpt",
    "grpo",
    "llama",
    "lm",
    "models",
    "parallelize",
    "preference",
    "pretrained",
    "prompts",
    "sft",
]
