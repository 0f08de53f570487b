"""The ASR task's export programs: waveforms in (the log-mel front end inside), CTC log-probabilities out;
with an attention decoder (or a sequence-to-sequence model's own) the decoder as a second program,
teacher-forced over the first one's encoder output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from audio.asr_loss import EOS, SOS
from audio.asr_model import asr_model
from audio.features import LogMel
from core.loop.task import ExportInputs, batch_dim


class WaveformCTC(nn.Module):
    """Waveforms to CTC log-probabilities: the task's log-mel front end, then the acoustic model. What an
    exported ASR model runs, so that its caller needs no feature code."""

    def __init__(self, features: LogMel, model: nn.Module) -> None:
        """`features` as evaluation computes them (no warping or SpecAugment), then `model`. A model with an
        attention decoder also returns the encoder's output, which its exported decoder reads."""
        super().__init__()
        self.features, self.model = features, model
        self.memory = getattr(model, "attention_decoder", None) is not None

    def forward(self, audio: torch.Tensor, audio_lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, S) zero-padded waveforms and their sample counts -> log-probabilities (B, T', V) and the
        frame counts (B,); with an attention decoder, the encoder's output (B, T', dim) third."""
        feats, lengths = self.features(audio, audio_lengths)
        if not self.memory:
            return self.model(feats, lengths)
        x, frames = self.model.encode(feats, lengths)
        return self.model.ctc_log_probs(x), frames, x


class DecoderLogits(nn.Module):
    """An attention decoder's teacher-forced form, as exported: token ids, the encoder's output and its frame
    counts in, next-token logits out."""

    def __init__(self, decoder: nn.Module) -> None:
        """`decoder`: a core.nn.decoder.TransformerDecoder."""
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor, encoder_out: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """(B, L) ids (<sos> first), (B, T', dim) and (B,) -> logits (B, L, V) over the next token."""
        return self.decoder(tokens, encoder_out, frames)


class EncoderProgram(nn.Module):
    """A sequence-to-sequence model's encoder, as exported: waveforms in, the encoder's output and its
    lengths out (the model's own front end inside), for a caller decoding with the exported decoder."""

    def __init__(self, model: nn.Module) -> None:
        """`model`: one with `encode(audio, lengths)` (Whisper)."""
        super().__init__()
        self.model = model

    def forward(self, audio: torch.Tensor, audio_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) zero-padded waveforms and sample counts -> (B, T', dim) encoder output, (B,) lengths."""
        return self.model.encode(audio, audio_lengths)


def export_inputs(
    model: nn.Module, batch: Any, length: int | None, sample_rate: int, tokenizer: Any
) -> ExportInputs:
    """Waveforms and their lengths in, log-probabilities and frame counts out (with an attention decoder,
    the encoder's output too, which `export_parts`' decoder reads): the log-mel front end is part of the
    export (it exports cleanly to both formats), so a caller needs no feature code. Any batch size and
    any duration from the shortest the model takes; `length` cuts the waveforms short."""
    # torch.export specialises sizes 0 and 1, so a dynamic time dim must keep >= 2 frames after the
    # model's subsampling: the shortest clip is the fewest samples that leave two
    if asr_model(model).seq2seq:
        return _seq2seq_export(model, batch, length, sample_rate)
    if asr_model(model).takes_audio:
        wrapped, shortest = model.eval(), model.min_samples(2)
    else:
        features = LogMel(sample_rate, model.n_mels).to(batch["audio"].device)
        frames = next(t for t in range(1, 64) if int(model.subsample.out_lengths(torch.tensor(t))) >= 2)
        shortest = (frames - 1) * features.hop
        wrapped = WaveformCTC(features, model).eval()
    audio, lengths = batch["audio"], batch["audio_lengths"]
    if length:
        length = max(length, shortest)
        audio, lengths = audio[:, :length], lengths.clamp(max=length)
    return ExportInputs(
        wrapped,
        (audio, lengths),
        ("audio", "audio_lengths"),
        ("log_probs", "frames") + (("encoder_out",) if getattr(wrapped, "memory", False) else ()),
        ({0: batch_dim(), 1: torch.export.Dim("samples", min=shortest)}, {0: batch_dim()}),
        f"float32 mono waveforms at {sample_rate} Hz (resample first), zero-padded to the longest, "
        f"at least {shortest} samples, with their int64 lengths; decode the log-probabilities with CTC "
        f"(id {tokenizer.blank} the blank; ids from 0: {tokenizer.symbols!r})",
        length=audio.shape[1],
    )


def _seq2seq_export(model: nn.Module, batch: Any, length: int | None, sample_rate: int) -> ExportInputs:
    """A sequence-to-sequence model's encoder program (`EncoderProgram`): waveforms up to the model's
    window in, encoder output and lengths out; its decoder is the `decoder` part."""
    net = asr_model(model).eval()
    # time is exported as a multiple of one encoder position's samples (320): export cannot prove the
    # shape guards of the front end's and stride-2 convolution's floor divisions for any sample count
    step = net.min_samples(2) - net.min_samples(1)
    audio, lengths = batch["audio"], batch["audio_lengths"]
    if length:
        audio, lengths = audio[:, :length], lengths.clamp(max=length)
    audio = F.pad(audio, (0, max(2, -(-audio.shape[1] // step)) * step - audio.shape[1]))
    shortest = 2 * step
    samples = step * torch.export.Dim("positions", min=2, max=net.max_samples // step)
    return ExportInputs(
        EncoderProgram(net).eval(),
        (audio, lengths),
        ("audio", "audio_lengths"),
        ("encoder_out", "frames"),
        ({0: batch_dim(), 1: samples}, {0: batch_dim()}),
        f"float32 mono waveforms at {sample_rate} Hz (resample first), zero-padded to the longest "
        f"and on to a multiple of {step} samples, {shortest} to {net.max_samples}, with their int64 "
        "lengths; decode with the decoder program, from the prompt its description gives",
        length=audio.shape[1],
    )


def export_parts(
    model: nn.Module, main_program: Callable[[], ExportInputs], batch: Any
) -> dict[str, ExportInputs]:
    """With an attention decoder (or a sequence-to-sequence model's own), `decoder`: its teacher-forced
    logits over the main program's encoder output, for a caller decoding token by token (<sos> or the
    model's prompt, then each chosen token, until the end token)."""
    seq2seq = asr_model(model).seq2seq
    if not asr_model(model).has_joint_decoder and not seq2seq:
        return {}
    main = main_program()
    with torch.no_grad():
        if seq2seq:
            memory, frames = main.module(*main.args)
        else:
            _, frames, memory = main.module(*main.args)
    targets, n = batch["targets"], batch["target_lengths"]
    if seq2seq:
        net = asr_model(model)
        first, decoder = net.prompt(targets.shape[0], targets.device), net.decoder
        start = f"the prompt {net.tokenizer.prompt}"
        end = net.tokenizer.eot
    else:
        first, decoder = torch.full_like(targets[:, :1], SOS), model.attention_decoder
        start, end = f"<sos> (id {SOS})", EOS
    tokens = torch.cat([first, targets], 1)[:, : int(n.max()) + first.shape[1]]
    # learned positions (Whisper's) end somewhere: the program's token dim must too
    positions = getattr(decoder, "positions", None)
    most_tokens = {} if positions is None else {"max": positions.shape[0]}
    time = torch.export.Dim("encoder_frames", min=2)
    return {
        "decoder": ExportInputs(
            DecoderLogits(decoder).eval(),
            (tokens, memory, frames),
            ("tokens", "encoder_out", "frames"),
            ("logits",),
            (
                {0: batch_dim(), 1: torch.export.Dim("tokens", min=1, **most_tokens)},
                {0: batch_dim(), 1: time},
                {0: batch_dim()},
            ),
            f"int64 token ids (B, L), {start} first, then the tokens chosen so far; the main program's "
            f"encoder_out and frames; the last position's logits pick the next token (id {end} ends"
            f"{'; ids after it are special and never chosen' if seq2seq else ''})",
        )
    }
