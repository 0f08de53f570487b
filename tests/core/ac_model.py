"""A small language model of `core.nn.transformer.Block`s and its gradients, for the activation-checkpointing
tests in one process and under torchrun (`dist_ac.py`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from core import compile as kc
from core.nn.transformer import Block

VOCAB, CONTEXT = 29, 16


class TinyLM(nn.Module):
    """Token + position embeddings, `layers` causal blocks (with dropout), a final norm and a head."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(CONTEXT, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, True) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, VOCAB) for `tokens` (B, L)."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, causal=True)
        return self.head(self.ln(x))


def tokens(batch: int = 4, seed: int = 1) -> torch.Tensor:
    """(batch, CONTEXT + 1) random tokens: inputs and next-token targets."""
    return torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(
    model: nn.Module, batch: torch.Tensor, seed: int = 5
) -> tuple[float, dict[str, torch.Tensor]]:
    """The next-token loss of `batch` and each parameter's gradient by name (dropout drawn from `seed`)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    grads = {}
    for name, p in kc.unwrap(model).named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return float(loss.detach()), grads
