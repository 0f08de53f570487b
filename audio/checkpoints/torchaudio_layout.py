"""torchaudio's wav2vec2/HuBERT/WavLM state-dict layout, the one `audio.wav2vec2.Wav2Vec2CTC`'s encoder has:
which layout a file is in, and its tensors renamed onto torchaudio's (fairseq's and Hugging Face's keys
through their modules' maps, WavLM's separate q/k/v joined)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

import torch
from torchaudio.models.wav2vec2.utils.import_huggingface import transform_wavlm_encoder_state

from audio.checkpoints import fairseq, hf
from core.errors import CheckpointError

LAYOUTS = ("torchaudio", "fairseq", "huggingface")
#: torchaudio's key of the positional convolution's weight-norm parts: magnitude (g) and direction (v)
_POS_CONV = "encoder.transformer.pos_conv_embed.conv."
_WEIGHT_NORM = {
    "weight_g": "parametrizations.weight.original0",
    "weight_v": "parametrizations.weight.original1",
}
#: what a file holds besides the encoder, by layout: output heads and pretraining-only parts, never loaded
_DROPPED = re.compile(
    r"^(aux|head|lm_head|proj|final_proj|project_q|project_hid|quantizer|label_embs_concat|target_glu)(\.|$)"
)
#: the learned mask embedding's name in each layout (torchaudio's builders have none; this module's is kept)
_MASK_KEYS = ("mask_embedding", "mask_emb", "masked_spec_embed")


def detect_layout(state: Mapping[str, torch.Tensor], path: str) -> str:
    """Which of torchaudio's, fairseq's or Hugging Face's key layouts a wav2vec2-family state dict has."""
    keys = [strip_prefix(k) for k in state]
    if any(k.startswith(("encoder.transformer.", "encoder.feature_projection.")) for k in keys):
        return "torchaudio"
    if any(k.startswith(("post_extract_proj.", "encoder.pos_conv.")) for k in keys):
        return "fairseq"
    if any(k.startswith(("feature_projection.", "encoder.pos_conv_embed.")) for k in keys):
        return "huggingface"
    raise CheckpointError(
        f"model.weights={path} is not a wav2vec2/HuBERT/WavLM state dict in any layout known here "
        f"(first keys: {', '.join(list(state)[:3])})",
        key="model.weights",
        value=str(path),
        valid=LAYOUTS,
    )


def strip_prefix(key: str) -> str:
    """`key` without the wrapper a fine-tuned or task model puts around the encoder: fairseq's
    w2v_encoder./w2v_model., Hugging Face's wav2vec2./hubert./wavlm."""
    for prefix in ("w2v_encoder.", "w2v_model.", "wav2vec2.", "hubert.", "wavlm."):
        key = key.removeprefix(prefix)
    return key


def to_torchaudio(
    state: Mapping[str, torch.Tensor], layout: str, arch: str, layers: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """(the encoder's tensors under torchaudio's names, the mask embedding or None, the keys dropped: heads
    and pretraining-only parts) of a state dict in `layout`."""
    encoder: dict[str, torch.Tensor] = {}
    mask, dropped = None, []
    for raw, value in state.items():
        key = strip_prefix(raw)
        if key in _MASK_KEYS:
            mask = value
            continue
        if _DROPPED.match(key):
            dropped.append(raw)
            continue
        if layout == "fairseq":
            key = fairseq.encoder_key(key)
        elif layout == "huggingface":
            key = hf.encoder_key(key)
        for old, new in _WEIGHT_NORM.items():  # older files keep weight norm's pre-parametrization names
            if key == f"{_POS_CONV}{old}":
                key = f"{_POS_CONV}{new}"
        encoder[key] = value
    split = "encoder.transformer.layers.0.attention.q_proj.weight"
    if (
        arch == "wavlm" and split in encoder
    ):  # fairseq's and HF's WavLM keep q/k/v apart, torchaudio joins them
        prefix = "encoder.transformer."
        inner = {k.removeprefix(prefix): v for k, v in encoder.items() if k.startswith(prefix)}
        # fewer layers in the file than here: the strict check below names what is missing
        with contextlib.suppress(KeyError):
            transform_wavlm_encoder_state(inner, layers)
        encoder = {k: v for k, v in encoder.items() if not k.startswith(prefix)}
        encoder |= {prefix + k: v for k, v in inner.items()}
    return encoder, mask, dropped
