"""A reward model as a reward function of `+task=grpo` (TRL's `nn.Module` rewards): a Hugging Face
`*ForSequenceClassification` folder of a decoder torchkiln loads (Llama, Qwen2/3, Mistral; safetensors
only, nothing downloads, no code from the folder runs), named in `task.rewards` by its path.

Each completion is scored as TRL scores it: a conversational prompt and its completion rendered with the
reward model's own chat template (no generation prompt), a text prompt followed by its completion;
tokenized by the folder's tokenizer.json without added special tokens; the score is the first label's
logit at the last token that is not the folder's pad id (transformers' rule for a right-padded batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from text.chat import ChatTemplate
from text.checkpoints.hf import expected_tensors, load_folder, read_classifier
from text.llama import DecoderConfig, Llama
from text.tokenizer import PretrainedTokenizer

#: completions a reward model scores in one forward
BATCH = 16


class RewardModel:
    """The reward function of a reward model folder (module docstring): called with TRL's keywords, it
    returns one float per completion."""

    def __init__(self, folder: str | Path) -> None:
        """Load `folder`'s decoder trunk and score head, tokenizer and chat template (on the CPU, in eval
        mode; `to` moves it beside the policy)."""
        hf, labels = read_classifier(folder)
        config = hf.config
        context = int(config.get("max_position_embeddings") or 4096)
        model = Llama(DecoderConfig(**{**hf.sizes, "tie_embeddings": False}, context=context))
        # the decoder's head is the classifier's score layer: the forward gives (B, L, labels)
        model.head = nn.Linear(model.config.d_model, labels, bias=False)
        tensors = {
            ("score.weight" if k == "lm_head.weight" else k): v for k, v in expected_tensors(model).items()
        }
        load_folder(model, hf, tensors)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = PretrainedTokenizer(hf.path)
        self.template = ChatTemplate.of_folder(hf.path)
        pad = config.get("pad_token_id")
        #: transformers scores each row at its last token that is not this id (None: the last token)
        self.pad_id: int | None = None if pad is None else int(pad)
        #: what the run's logs name the reward by (`text.rewards.resolve_all`), as TRL names a reward model
        self.folder_name = hf.path.name

    def to(self, device: torch.device) -> RewardModel:
        """The model moved to `device` (where the policy samples)."""
        self.model.to(device)
        return self

    def text(self, prompt: Any, completion: Any) -> str:
        """The text scored: a message list and its completion's messages through the chat template, or a
        text prompt and its completion joined."""
        if isinstance(prompt, str):
            return prompt + completion
        return self.template.render([*prompt, *completion])

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **fields: Any) -> list[float]:
        """The score of each completion of its prompt (TRL's reward contract)."""
        ids = [self.tokenizer.encode(self.text(p, c)) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(ids), BATCH):
            out += self._scores(ids[start : start + BATCH])
        return out

    def _scores(self, rows: list[list[int]]) -> list[float]:
        """The first label's logit of each of `rows` (ids), one right-padded forward."""
        device = next(self.model.parameters()).device
        width = max(len(r) for r in rows)
        pad = 0 if self.pad_id is None else self.pad_id
        tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
        # transformers' rule: the last position whose id is not the pad id (a row ending in it is scored
        # before it, as there); with no pad id, each row's own last token
        if self.pad_id is None:
            last = torch.tensor([len(r) - 1 for r in rows], device=device)
        else:
            positions = torch.arange(width, device=device)
            last = (positions * (tokens != self.pad_id)).argmax(-1)
        with torch.no_grad():
            logits = self.model(tokens)
        return logits[torch.arange(len(rows), device=device), last, 0].float().tolist()
