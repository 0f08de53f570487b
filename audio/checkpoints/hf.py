"""Hugging Face model folders (config.json beside model.safetensors or pytorch_model.bin): a Whisper's tensors
renamed to OpenAI's, and a wav2vec2/HuBERT/WavLM encoder's keys and sizes in torchaudio's terms."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from audio.checkpoints.openai_whisper import dims_from
from audio.whisper import WhisperDims
from core.errors import CheckpointError

#: a folder's weights, in the order transformers' from_pretrained prefers them
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

#: Hugging Face's Whisper key pieces -> OpenAI's, applied in order
_WHISPER_RENAMES = (
    (r"^(model\.)?", ""),
    (r"\.layers\.", ".blocks."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.self_attn\.", ".attn."),
    (r"\.encoder_attn\.", ".cross_attn."),
    (r"\.q_proj\.", ".query."),
    (r"\.k_proj\.", ".key."),
    (r"\.v_proj\.", ".value."),
    (r"\.out_proj\.", ".out."),
    (r"\.fc1\.", ".mlp.0."),
    (r"\.fc2\.", ".mlp.2."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"^encoder\.embed_positions\.weight$", "encoder.positional_embedding"),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
)


def whisper_state(
    state: Mapping[str, torch.Tensor], config: Path, path: str
) -> tuple[dict[str, torch.Tensor], WhisperDims]:
    """A Hugging Face Whisper's tensors under OpenAI's names (its tied proj_out dropped) and the sizes its
    config.json gives."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"model.weights={path}: {config} is not readable JSON ({type(e).__name__})",
            key="model.weights",
            value=path,
            valid=("a Hugging Face config.json",),
        ) from None
    names = {
        "n_mels": "num_mel_bins",
        "n_audio_ctx": "max_source_positions",
        "n_audio_state": "d_model",
        "n_audio_head": "encoder_attention_heads",
        "n_audio_layer": "encoder_layers",
        "n_vocab": "vocab_size",
        "n_text_ctx": "max_target_positions",
        "n_text_state": "d_model",
        "n_text_head": "decoder_attention_heads",
        "n_text_layer": "decoder_layers",
    }
    dims = dims_from({ours: cfg.get(theirs) for ours, theirs in names.items()}, path, str(config))
    out = {}
    for key, value in state.items():
        if key == "proj_out.weight":
            continue
        for pattern, repl in _WHISPER_RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out, dims


def encoder_sizes(config: dict[str, Any], normalize: Any) -> dict[str, Any]:
    """The sizes in a transformers config.json (Wav2Vec2Config, HubertConfig, WavLMConfig names)."""
    names = {
        "hidden_size": "dim",
        "num_hidden_layers": "layers",
        "num_attention_heads": "heads",
        "intermediate_size": "ff_dim",
        "conv_bias": "conv_bias",
        "num_conv_pos_embeddings": "pos_conv_kernel",
        "num_conv_pos_embedding_groups": "pos_conv_groups",
        "do_stable_layer_norm": "layer_norm_first",
        "num_buckets": "num_buckets",
        "max_bucket_distance": "max_distance",
    }
    sizes = {ours: config[theirs] for theirs, ours in names.items() if theirs in config}
    if "feat_extract_norm" in config:
        sizes["extractor_mode"] = f"{config['feat_extract_norm']}_norm"
    conv = [config.get(k) for k in ("conv_dim", "conv_kernel", "conv_stride")]
    if all(isinstance(c, list) for c in conv):
        sizes["conv_layers"] = tuple(zip(*conv, strict=True)) if len({len(c) for c in conv}) == 1 else None
    if normalize is not None:
        sizes["normalize_audio"] = normalize
    return sizes


def encoder_key(key: str) -> str:
    """A Hugging Face key (prefix stripped) in torchaudio's layout: the encoder's parts move under
    `encoder.`, the Transformer's under `encoder.transformer.`."""
    if key.startswith("feature_projection."):
        return f"encoder.{key}"
    if key.startswith("encoder."):
        return f"encoder.transformer.{key.removeprefix('encoder.')}"
    return key
