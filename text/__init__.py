"""torchkiln text: the embedded KJV corpus, tokenizers, GPT, Llama-style and encoder models, LM and
classification tasks.

Importing the package registers its datasets, models and tasks in core.registry, and the models'
tensor-parallel plans with core.distributed.
"""

from text import classification, classifier, gpt, llama, lm, parallelize, pretrained

__all__ = ["classification", "classifier", "gpt", "llama", "lm", "parallelize", "pretrained"]
