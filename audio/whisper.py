"""Whisper (Radford et al., 2022) fine-tuned on the ASR task's transcripts: its log-mel front end, encoder,
byte-level BPE tokenizer and attention decoder, from a local pretrained file.

Whisper's encoder layer is core's GPT-2-layout `core.nn.transformer.Block` (pre-norm, fused q/k/v, exact GELU,
biases) and its decoder layer core's `DecoderBlock`; the decoder is core's `TransformerDecoder` with learned
positions, unscaled and tied embeddings. So attention runs through `core.attention` as every other model's
does, and decoding uses core's KV cache: the encoder's keys and values are projected once per utterance.

This module builds the plain network from its sizes; `model.weights=PATH` (OpenAI's .pt, a Hugging Face or a
CTranslate2 folder) is read and loaded afterwards by `audio.checkpoints.whisper_files` (the registered
builder in `audio.pretrained` chains the two).

Fine-tuning: audio is not padded to Whisper's 30 s window; each utterance's own frames are encoded with the
padding masked, which is most of what makes it affordable on a CPU. The token embedding (also the output
projection) is frozen by default: it is half the network, and freezing it made each step faster at no
visible cost in WER (docs/benchmarks/asr.md § Whisper tiny.en fine-tuned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from audio.asr_model import ASRModel
from audio.transcripts import normalize_transcript
from core.bounds import Bounds
from core.errors import CheckpointError, ConfigError, DataError
from core.nn.decoder import TransformerDecoder, length_mask
from core.nn.transformer import Block

SAMPLE_RATE = 16_000
N_FFT, HOP = 400, 160  # 25 ms windows every 10 ms


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


def _configured_tokenizer(tokenizer: str, n_vocab: int) -> WhisperTokenizer:
    """The tokenizer model.tokenizer names, or the ConfigError for a missing file or one with more tokens than
    the model's `n_vocab`."""
    tok_path = Path(tokenizer).expanduser() if tokenizer else None
    if tok_path is None or not tok_path.is_file():
        where = f"model.tokenizer={tokenizer}: no such file" if tokenizer else "no tokenizer.json given"
        raise ConfigError(
            f"{where}; set model.tokenizer=PATH to a Whisper tokenizer.json (a Hugging Face or "
            "CTranslate2 Whisper folder has one)",
            key="model.tokenizer",
            value=str(tokenizer),
            valid=("a Whisper tokenizer.json",),
        )
    loaded = WhisperTokenizer(tok_path, n_vocab)
    if len(loaded) > n_vocab:
        raise ConfigError(
            f"model.tokenizer={tok_path} has {len(loaded)} tokens, more than the model's "
            f"{n_vocab} (n_vocab); give the tokenizer of the same Whisper",
            key="model.tokenizer",
            value=str(tok_path),
            valid=(f"<= {n_vocab} tokens",),
        )
    return loaded


def _check_widths(dims: WhisperDims) -> None:
    """The ConfigError for an encoder and decoder of different widths (the decoder attends to the encoder's
    output as it is)."""
    if dims.n_audio_state != dims.n_text_state:
        raise ConfigError(
            f"model.n_audio_state={dims.n_audio_state} must equal model.n_text_state={dims.n_text_state}",
            key="model.n_text_state",
            value=str(dims.n_text_state),
        )


class WhisperASR(ASRModel):
    """Raw waveforms -> Whisper's encoder -> its decoder's next-token logits over its BPE vocabulary: a
    sequence-to-sequence model for the ASR task (trained by teacher-forced cross-entropy, decoded greedily
    with the KV cache)."""

    takes_audio = True
    seq2seq = True
    size_keys = SIZE_KEYS

    def __init__(
        self,
        *,
        tokenizer: str = "",
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

        tokenizer: a Whisper tokenizer.json; empty: the one in the weights' folder
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
        self.dims, self.pad_to_window = dims, pad_to_window
        self.tokenizer = _configured_tokenizer(tokenizer, dims.n_vocab)
        _check_widths(dims)
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

    def forward(
        self, inputs: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced next-token logits (B, L, n_vocab) of `tokens` (B, L: the prompt, then the
        transcript) over the encoding of waveforms `inputs`; `generate` transcribes without tokens."""
        if tokens is None:
            raise ValueError("Whisper's forward scores the decoder's tokens; generate() transcribes")
        memory, frames = self.encode(inputs, lengths)
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
