"""The registered Llama-style decoders (`llama` and its size presets), built as timm's builder does: the
plain `text.llama.Llama` from its sizes (a Hugging Face folder's own sizes when `model.weights` names one),
then the folder's tensors loaded by `text.checkpoints.hf`. The model's constructor never reads a file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.errors import ConfigError
from core.logging.messages import warn
from core.registry import MODELS, with_model_keywords
from text.checkpoints.hf import load_folder, read_folder
from text.llama import DecoderConfig, Llama

#: Llama 3-shaped sizes (`text.llama.DecoderConfig` fields) per preset: `llama` (the class defaults, a few M
#: parameters: CPU runs and tests), then 125M (GPT-2 small's depth and width, its MLP sized so that with
#: GPT-2's 50,257-token vocabulary the model has 125M parameters), Llama 3.2 1B's and Llama 3.1 8B's. The
#: vocabulary is the task tokenizer's, so with another tokenizer the counts differ by the embedding
#: (tests/text/test_llama.py counts them)
PRESETS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama_125m": {"n_layer": 12, "n_head": 12, "n_kv_head": 4, "d_model": 768, "hidden": 2432},
    "llama_1b": {
        "n_layer": 16,
        "n_head": 32,
        "n_kv_head": 8,
        "d_model": 2048,
        "hidden": 8192,
        "rope_theta": 500_000.0,
        "rope_factor": 32.0,
        "rope_original_context": 8192,
    },
    "llama_8b": {
        "n_layer": 32,
        "n_head": 32,
        "n_kv_head": 8,
        "d_model": 4096,
        "hidden": 14336,
        "rope_theta": 500_000.0,
        "rope_factor": 8.0,
        "rope_original_context": 8192,
        "tie_embeddings": False,
    },
}
#: Qwen3-MoE-shaped sizes (text.moe): `qwen3_moe` (8 experts, 2 per token, a few M parameters: CPU runs and
#: tests) and Qwen3-30B-A3B's (128 experts, 8 per token; its config.json's sizes)
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "qk_norm": True,
        "n_experts": 8,
        "experts_per_token": 2,
        "expert_hidden": 256,
        "norm_topk_prob": True,
    },
    "qwen3_moe_30b_a3b": {
        "qk_norm": True,
        "n_layer": 48,
        "n_head": 32,
        "n_kv_head": 4,
        "d_model": 2048,
        "head_dim": 128,
        "hidden": 6144,
        "n_experts": 128,
        "experts_per_token": 8,
        "expert_hidden": 768,
        "norm_topk_prob": True,
        "rope_theta": 1_000_000.0,
        "norm_eps": 1e-6,
        "tie_embeddings": False,
    },
}


def build_llama(*, weights: str = "", **settings: Any) -> Llama:
    """A Llama/Qwen-style decoder built to its sizes, then a Hugging Face folder's weights loaded.

    weights: a local Hugging Face folder of a decoder text.checkpoints.hf.ARCHITECTURES lists (Llama, Qwen2,
        Qwen3, Qwen3-MoE, ...: config.json + model.safetensors or a sharded index; safetensors only, nothing
        downloads); its sizes replace the ones below. Empty: random init
    """
    if not weights:
        return Llama(DecoderConfig(**settings))
    folder = read_folder(weights)
    vocab = settings.get("vocab_size")
    if vocab is not None and vocab > folder.sizes["vocab_size"]:
        # the task's tokenizer would feed ids the embedding has no row for
        raise ConfigError(
            f"the task's tokenizer has {vocab} ids, more than the {folder.sizes['vocab_size']} of "
            f"model.weights={weights}; use a tokenizer of the model's vocabulary",
            key="vocab_size",
            value=str(vocab),
            valid=(f"<= {folder.sizes['vocab_size']}",),
        )
    trained, context = folder.config.get("max_position_embeddings"), settings.get("context")
    if isinstance(trained, int) and isinstance(context, int) and context > trained:
        # allowed (longer contexts are trained on purpose), but positions past the folder's were never seen
        warn(
            f"task.context={context} is past the {trained} positions of model.weights={weights} (config.json "
            "max_position_embeddings): the model never saw the positions beyond"
        )
    model = Llama(DecoderConfig(**{**settings, **folder.sizes}))
    model.hf_config = folder.config  # kept, so writing the model back keeps the folder's token ids
    if model.tok_emb.weight.is_meta:
        # built on the meta device for a sharded run: the parallelize stage shards it first, then each rank
        # reads its own slices (`load_sharded`), so no rank materialises the whole model
        model.hf_folder = folder
        return model
    load_folder(model, folder)
    return model


def load_sharded(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A model `build_llama` built on the meta device, after FSDP/TP sharded it: its storage made on
    `device` and each rank's shards of the folder's tensors read in (`text.checkpoints.hf.load_folder`)."""
    folder = getattr(model, "hf_folder", None)
    if folder is None:  # a model=NAME whose builder takes no Hugging Face folder (the GPT)
        raise ConfigError(
            f"{type(model).__name__} was not built from a Hugging Face folder on the meta device; "
            "model.weights names one for model=llama and its presets",
            key="model.weights",
        )
    model.to_empty(device=device)  # the Llama holds no buffers: every tensor is a parameter, loaded next
    load_folder(model, folder)
    return model


with_model_keywords(build_llama, Llama, DecoderConfig)
for _name, _sizes in PRESETS.items():
    MODELS.register_preset(
        _name,
        build_llama,
        f"Llama/Qwen-style decoder ({_name.removeprefix('llama_').removeprefix('llama') or 'debug'} sizes; "
        "model.weights=DIR: a Hugging Face Llama/Qwen2/Qwen3 folder), grouped-query attention, rotary "
        "positions, SwiGLU.",
        **_sizes,
    )
for _name, _sizes in MOE_PRESETS.items():
    MODELS.register_preset(
        _name,
        build_llama,
        f"Qwen3-MoE-style decoder ({_name.removeprefix('qwen3_moe_') or 'debug'} sizes; model.weights=DIR: a "
        "Hugging Face Qwen3MoeForCausalLM folder): a top-k softmax router over SwiGLU experts (text.moe).",
        **_sizes,
    )
