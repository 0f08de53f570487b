"""CTranslate2 model folders (config.json + model.bin, e.g. faster-whisper's): model.bin parsed here as
plain arrays (nothing evaluated), a Whisper's tensors renamed to OpenAI's."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from audio.whisper import WhisperDims
from core.errors import CheckpointError

#: CTranslate2's dtype codes (its model.bin header), as numpy dtypes
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def is_ctranslate2(file: Path) -> bool:
    """Whether `file` starts as a CTranslate2 model.bin (a small version number, then a spec name)."""
    with file.open("rb") as f:
        head = f.read(6)
    return len(head) == 6 and 1 <= struct.unpack_from("<I", head)[0] <= 16


def read_model_bin(file: Path, path: str) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    """(spec name, variables, aliases) of a CTranslate2 model.bin: a header, then each variable's name, rank,
    dims, dtype and bytes; read as arrays, nothing evaluated."""
    data = memoryview(file.read_bytes())
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<H")
        text = bytes(data[pos : pos + n - 1]).decode()  # NUL-terminated
        pos += n
        return text

    try:
        take("<I")  # format version
        spec = string()
        take("<I")  # spec revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("<I")):
            name, rank = string(), take("<B")
            shape = [take("<I") for _ in range(rank)]
            dtype, nbytes = _DTYPES.get(take("<B")), take("<I")
            if dtype is None:
                raise ValueError(f"{name} has a dtype this reader does not know")
            count = nbytes // np.dtype(dtype).itemsize
            variables[name] = np.frombuffer(data, dtype, count, pos).reshape(shape)
            pos += nbytes
        aliases = {string(): string() for _ in range(take("<I"))}
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"model.weights={path}: {file} is not a readable CTranslate2 model ({e})",
            key="model.weights",
            value=path,
            valid=("a CTranslate2 model.bin",),
        ) from None
    return spec, variables, aliases


def whisper_state(file: Path, path: str) -> tuple[dict[str, torch.Tensor], WhisperDims]:
    """A CTranslate2 Whisper's tensors under OpenAI's names (its fused q/k/v split, the key's zero bias
    dropped), and the sizes its shapes and head counts give."""
    spec, v, aliases = read_model_bin(file, path)
    _check_float_whisper(spec, v, path)
    for alias, target in aliases.items():
        v.setdefault(alias, v[target])
    names = _OpenAINames(v, path)
    n_enc, n_dec = names.encoder(), names.decoder()
    return names.out, _whisper_dims(names.out, v, n_enc, n_dec)


def _check_float_whisper(spec: str, v: dict[str, np.ndarray], path: str) -> None:
    """The CheckpointError for a CTranslate2 model that is no Whisper, or a quantized one."""
    if "Whisper" not in spec:
        raise CheckpointError(
            f"model.weights={path} is a CTranslate2 {spec}, not a Whisper",
            key="model.weights",
            value=path,
            valid=("WhisperSpec",),
        )
    scaled = sorted(k for k in v if k.endswith("_scale"))
    if scaled:  # int8/int16 weights with their scales: read as plain tensors they would be garbage
        raise CheckpointError(
            f"model.weights={path} is a quantized CTranslate2 model ({scaled[0]}, ...); convert it again "
            "with --quantization float32 or float16 (ct2-transformers-converter), or give the original",
            key="model.weights",
            value=path,
            valid=("a float32 or float16 CTranslate2 model",),
        )


class _OpenAINames:
    """A CTranslate2 Whisper's variables `v` put into `out` under OpenAI's state-dict keys."""

    def __init__(self, v: dict[str, np.ndarray], path: str) -> None:
        self.v, self.path = v, path
        self.out: dict[str, torch.Tensor] = {}

    def t(self, name: str) -> torch.Tensor:
        """Variable `name` as a float32 tensor, or the CheckpointError naming it."""
        if name not in self.v:
            raise CheckpointError(
                f"model.weights={self.path}: the CTranslate2 model has no {name}",
                key="model.weights",
                value=self.path,
                valid=("a CTranslate2 WhisperSpec",),
            )
        return torch.from_numpy(np.array(self.v[name], dtype=np.float32))

    def layers(self, prefix: str) -> int:
        """Layers of the encoder or the decoder (`prefix`)."""
        return len({m.group(1) for k in self.v if (m := re.match(rf"{prefix}/layer_(\d+)/", k))})

    def put(self, ours: str, theirs: str, parts: tuple[str, str] = ("weight", "bias")) -> None:
        """OpenAI's `ours`.weight/.bias from CTranslate2's `theirs`/<parts> (a norm's: gamma, beta)."""
        self.out[f"{ours}.weight"], self.out[f"{ours}.bias"] = (self.t(f"{theirs}/{part}") for part in parts)

    def attention(self, ours: str, theirs: str, fused: bool) -> None:
        """Self-attention's q/k/v are one fused linear_0; cross-attention's q is linear_0, k/v linear_1."""
        t = self.t
        if fused:
            w, b = t(f"{theirs}/linear_0/weight"), t(f"{theirs}/linear_0/bias")
            parts = zip(("query", "key", "value"), w.chunk(3), b.chunk(3), strict=True)
        else:
            kv_w, kv_b = t(f"{theirs}/linear_1/weight").chunk(2), t(f"{theirs}/linear_1/bias").chunk(2)
            query = ("query", t(f"{theirs}/linear_0/weight"), t(f"{theirs}/linear_0/bias"))
            parts = (query, ("key", kv_w[0], kv_b[0]), ("value", kv_w[1], kv_b[1]))
        for name, w, b in parts:
            self.out[f"{ours}.{name}.weight"] = w
            if name != "key":  # OpenAI's key projection has no bias; CTranslate2 stores zeros
                self.out[f"{ours}.{name}.bias"] = b
        self.put(f"{ours}.out", f"{theirs}/linear_{1 if fused else 2}")
        self.put(f"{ours}_ln", f"{theirs}/layer_norm", ("gamma", "beta"))

    def mlp(self, ours: str, theirs: str) -> None:
        """A block's feed-forward layers and their norm."""
        self.put(f"{ours}.mlp.0", f"{theirs}/ffn/linear_0")
        self.put(f"{ours}.mlp.2", f"{theirs}/ffn/linear_1")
        self.put(f"{ours}.mlp_ln", f"{theirs}/ffn/layer_norm", ("gamma", "beta"))

    def encoder(self) -> int:
        """Put the encoder's tensors; its layer count."""
        for i in ("1", "2"):
            self.put(f"encoder.conv{i}", f"encoder/conv{i}")
        self.out["encoder.positional_embedding"] = self.t("encoder/position_encodings/encodings")
        n = self.layers("encoder")
        for i in range(n):
            self.attention(f"encoder.blocks.{i}.attn", f"encoder/layer_{i}/self_attention", fused=True)
            self.mlp(f"encoder.blocks.{i}", f"encoder/layer_{i}")
        self.put("encoder.ln_post", "encoder/layer_norm", ("gamma", "beta"))
        return n

    def decoder(self) -> int:
        """Put the decoder's tensors; its layer count."""
        self.out["decoder.token_embedding.weight"] = self.t("decoder/embeddings/weight")
        self.out["decoder.positional_embedding"] = self.t("decoder/position_encodings/encodings")
        n = self.layers("decoder")
        for i in range(n):
            self.attention(f"decoder.blocks.{i}.attn", f"decoder/layer_{i}/self_attention", fused=True)
            self.attention(f"decoder.blocks.{i}.cross_attn", f"decoder/layer_{i}/attention", fused=False)
            self.mlp(f"decoder.blocks.{i}", f"decoder/layer_{i}")
        self.put("decoder.ln", "decoder/layer_norm", ("gamma", "beta"))
        return n


def _whisper_dims(
    out: dict[str, torch.Tensor], v: dict[str, np.ndarray], n_enc: int, n_dec: int
) -> WhisperDims:
    """The sizes the OpenAI-named tensors `out` give, with the head counts CTranslate2 stores (else width
    / 64)."""
    heads = {k: int(v[f"{k}/num_heads"]) for k in ("encoder", "decoder") if f"{k}/num_heads" in v}
    emb, conv1 = out["decoder.token_embedding.weight"], out["encoder.conv1.weight"]
    return WhisperDims(
        n_mels=conv1.shape[1],
        n_audio_ctx=out["encoder.positional_embedding"].shape[0],
        n_audio_state=conv1.shape[0],
        n_audio_head=heads.get("encoder", conv1.shape[0] // 64),
        n_audio_layer=n_enc,
        n_vocab=emb.shape[0],
        n_text_ctx=out["decoder.positional_embedding"].shape[0],
        n_text_state=emb.shape[1],
        n_text_head=heads.get("decoder", emb.shape[1] // 64),
        n_text_layer=n_dec,
    )
