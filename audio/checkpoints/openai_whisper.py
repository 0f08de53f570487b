"""OpenAI's Whisper checkpoints (`tiny.en.pt`...: `dims` + `model_state_dict`, read with weights_only=True),
and OpenAI's tensor names mapped onto `audio.whisper.WhisperASR`'s: the layout the other Whisper formats
(Hugging Face's, CTranslate2's) are renamed to first."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from audio.whisper import SIZE_KEYS, WhisperDims
from core.errors import CheckpointError


def read_openai(raw: Any, path: str) -> tuple[dict[str, torch.Tensor], WhisperDims] | None:
    """(OpenAI-named tensors, sizes) of an OpenAI checkpoint already read as plain containers; None when
    `raw` is not one."""
    if not (
        isinstance(raw, dict)
        and isinstance(raw.get("dims"), dict)
        and isinstance(raw.get("model_state_dict"), dict)
    ):
        return None
    dims = dims_from(raw["dims"], path, "its dims")
    return {k: v for k, v in raw["model_state_dict"].items() if k != "alignment_heads"}, dims


def dims_from(given: Mapping[str, Any], path: str, where: str) -> WhisperDims:
    """WhisperDims from a file's sizes, or one CheckpointError naming the first missing or bad one."""
    for key in SIZE_KEYS:
        value = given.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(
                f"model.weights={path}: {where} give {key}={value!r}, not a positive integer",
                key="model.weights",
                value=path,
                valid=SIZE_KEYS,
            )
    return WhisperDims(**{k: int(given[k]) for k in SIZE_KEYS})


def to_model_state(openai: Mapping[str, torch.Tensor], dims: WhisperDims) -> dict[str, torch.Tensor]:
    """OpenAI-named Whisper tensors as this module's state dict: q/k/v fused (head-major in the encoder's
    core Blocks), the key's absent bias as zeros, MLP and norm names core's."""
    names = _CoreNames(openai, dims)
    names.encoder()
    names.decoder()
    out, src = names.out, names.src
    if src:  # tensors of layers this size has none of: the strict load names the first ones
        out |= src
    return {k: v.float() for k, v in out.items()}


class _CoreNames:
    """OpenAI-named Whisper tensors taken from `src` one by one into `out` under core's names."""

    def __init__(self, openai: Mapping[str, torch.Tensor], dims: WhisperDims) -> None:
        self.src, self.dims = dict(openai), dims
        self.out: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        """The tensor `key`, removed from `src`, or the CheckpointError naming it."""
        if key not in self.src:
            raise CheckpointError(
                f"the Whisper weights have no {key} (model sizes {asdict(self.dims)})",
                key="model.weights",
                value=key,
                valid=("a complete Whisper state dict",),
            )
        return self.src.pop(key)

    def qkv(self, prefix: str, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections `names` of `prefix` fused into one weight and bias (a key's absent bias: zeros)."""
        ws, bs = [], []
        for n in names:
            w = self.take(f"{prefix}.{n}.weight")
            ws.append(w)
            b = self.src.pop(f"{prefix}.{n}.bias", None)
            bs.append(torch.zeros(w.shape[0], dtype=w.dtype) if b is None else b)
        return torch.cat(ws), torch.cat(bs)

    def put(self, ours: str, theirs: str) -> None:
        """Our `ours`.weight/.bias from OpenAI's `theirs`.weight/.bias."""
        self.out[f"{ours}.weight"], self.out[f"{ours}.bias"] = (
            self.take(f"{theirs}.weight"),
            self.take(f"{theirs}.bias"),
        )

    def mlp(self, block: str) -> None:
        """A block's feed-forward layers."""
        self.put(f"{block}.fc", f"{block}.mlp.0")
        self.put(f"{block}.fc_out", f"{block}.mlp.2")

    def encoder(self) -> None:
        """The encoder's convolutions, positions, blocks and final norm."""
        out = self.out
        for i in ("1", "2"):
            self.put(f"encoder.conv{i}", f"encoder.conv{i}")
        out["encoder.positions"] = self.take("encoder.positional_embedding")
        d, h = self.dims.n_audio_state, self.dims.n_audio_head
        for i in range(self.dims.n_audio_layer):
            p = f"encoder.blocks.{i}"
            w, b = self.qkv(f"{p}.attn", ("query", "key", "value"))
            # core's Block keeps fused rows head-major, (head, q|k|v, head_dim): permuted from (q|k|v, head,
            # dim)
            out[f"{p}.qkv_by_head.weight"] = w.view(3, h, d // h, d).transpose(0, 1).reshape(3 * d, d)
            out[f"{p}.qkv_by_head.bias"] = b.view(3, h, d // h).transpose(0, 1).reshape(3 * d)
            self.put(f"{p}.proj", f"{p}.attn.out")
            self.put(f"{p}.ln1", f"{p}.attn_ln")
            self.put(f"{p}.ln2", f"{p}.mlp_ln")
            self.mlp(p)
        self.put("encoder.ln_post", "encoder.ln_post")

    def decoder(self) -> None:
        """The decoder's embedding, positions, blocks and final norm."""
        out = self.out
        out["decoder.embed.weight"] = self.take("decoder.token_embedding.weight")
        out["decoder.positions"] = self.take("decoder.positional_embedding")
        for i in range(self.dims.n_text_layer):
            p = f"decoder.blocks.{i}"
            out[f"{p}.self_attn.qkv.weight"], out[f"{p}.self_attn.qkv.bias"] = self.qkv(
                f"{p}.attn", ("query", "key", "value")
            )
            self.put(f"{p}.self_attn.proj", f"{p}.attn.out")
            self.put(f"{p}.cross_attn.q", f"{p}.cross_attn.query")
            out[f"{p}.cross_attn.kv.weight"], out[f"{p}.cross_attn.kv.bias"] = self.qkv(
                f"{p}.cross_attn", ("key", "value")
            )
            self.put(f"{p}.cross_attn.proj", f"{p}.cross_attn.out")
            for n, theirs in (("ln1", "attn_ln"), ("ln2", "cross_attn_ln"), ("ln3", "mlp_ln")):
                self.put(f"{p}.{n}", f"{p}.{theirs}")
            self.mlp(p)
        self.put("decoder.norm", "decoder.ln")
