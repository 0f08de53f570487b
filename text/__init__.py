"""torchkiln text: the embedded KJV corpus, tokenizers, GPT and encoder models, LM and classification tasks.

Importing the package registers its datasets, models and tasks in core.registry.
"""

from text import classification, classifier, gpt, lm

__all__ = ["classification", "classifier", "gpt", "lm"]
