"""The speech-recognition task: a speech model (`audio.asr_model.ASRModel`: Conformer-CTC, a wav2vec2-family
encoder or Whisper) trained on transcripts and scored by WER and CER. The model says what it takes and has;
its loss (`audio.asr_loss`), decoding (`audio.asr_decoding`) and export (`audio.asr_export`) follow."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import nn
from torch.utils.data import Dataset

import audio.conformer  # noqa: F401 - registers the conformer_ctc_* models
import audio.datasets  # noqa: F401 - registers the speech datasets
import audio.pretrained  # noqa: F401 - registers the whisper and wav2vec2/hubert/wavlm_ctc models
from audio import asr_export
from audio.asr_decoding import DECODERS, Decoding, Scores
from audio.asr_frontend import FrontEnd
from audio.asr_loss import asr_loss, model_inputs
from audio.asr_model import asr_model, check_ctc_head, registered_class
from audio.asr_predict import (
    MANIFEST_SUFFIXES,
    AudioInput,
    resampled,
    scores,
    utterances,
    waveform_batch,
)
from audio.asr_run_files import save_model_files, saved_model_config, saved_tokenizer
from audio.ctc import (
    TOKENIZERS,
    CharTokenizer,
    Lexicon,
    SubwordTokenizer,
    make_tokenizer,
)
from audio.datasets import (
    SpeechDataset,
    collate_speech,
    read_audio,
    without_unalignable,
    without_unfit,
)
from audio.features import LogMel
from audio.ngram import NGramLM
from audio.scoring import UtteranceScores
from audio.shards import speech_batches  # also registers speech_shards
from audio.wav2vec2 import UpdateCounter
from audio.whisper import WhisperTokenizer
from core.bounds import Bounds
from core.data.samplers import LengthBucketBatchSampler, ShardWindowBatchSampler
from core.errors import ConfigError, unknown_choice
from core.loop.callbacks import Callback
from core.loop.task import ExportInputs, ShapeHints, StepOutput, Task
from core.registry import DATASETS, MODELS, TASKS

log = logging.getLogger(__name__)

__all__ = ["DECODERS", "MANIFEST_SUFFIXES", "ASRTask", "AudioInput"]


def _plain(cfg: Any) -> Any:
    """A config mapping (dict or OmegaConf node) as plain dicts and lists, without importing OmegaConf."""
    if isinstance(cfg, Mapping):
        return {str(k): _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, Sequence) and not isinstance(cfg, str):
        return [_plain(v) for v in cfg]
    return cfg


def _at_least(key: str, value: float, low: float, note: str = "") -> None:
    """The ConfigError for a setting below its lowest value, with its key, value and bound as fields."""
    if value < low:
        raise ConfigError(
            f"{key}={value} must be >= {low}{note}", key=key, value=str(value), valid=(f">= {low}",)
        )


def _checked_sections(
    model: Mapping[str, Any], data: Mapping[str, Any], num_buckets: int, tokenizer: str, batch_duration: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and data sections as plain dicts, checked with the task's batching and tokenizer settings
    before any data is read: each section names its builder, the data section's values are valid (e.g.
    data.on_bad_sample)."""
    model_cfg, data_cfg = _plain(model), _plain(data)
    for kind, cfg in (("model", model_cfg), ("data", data_cfg)):
        if "name" not in cfg:
            raise ConfigError(f"the {kind} config has no 'name'; pick one with {kind}=NAME")
    DATASETS.check_section(data_cfg)
    _at_least("task.num_buckets", num_buckets, 1)
    if tokenizer not in TOKENIZERS:
        raise unknown_choice("task.tokenizer", tokenizer, TOKENIZERS)
    _at_least("task.batch_duration", batch_duration, 0, " (0: off)")
    return model_cfg, data_cfg


@TASKS.register("asr")
class ASRTask(Task):
    """Speech recognition scored by WER and CER; speed perturbation runs as clips are read, noise,
    reverberation, features and SpecAugment on the training device.

    spec_augment: frequency and time masking of training features (SpecAugment)
    freq_masks: frequency masks per training utterance
    freq_width: widest frequency mask, in mel bins
    time_masks: time masks per training utterance
    time_width: widest time mask, in 10 ms frames
    freq_warp: largest random stretch of the mel axis while training, as a fraction (0: off)
    speed_perturb: speeds each training clip is played at, one drawn per clip, e.g. [0.9,1.0,1.1]
        (resampled, rounded to 0.01; [] : off)
    noise_prob: fraction of training utterances given white or pink noise (0: off)
    noise_snr: [lowest, highest] signal-to-noise ratio of that noise, in dB
    reverb_prob: fraction of training utterances convolved with a synthetic room response (0: off)
    reverb_rt60: [shortest, longest] reverberation time (60 dB decay) of those responses, in seconds
    decoder: greedy (best path), lexicon (greedy, unknown words snapped to the training vocabulary),
        beam (lexicon-free beam search), beam_lexicon (beam search over the training words' spellings)
        or beam_lm (beam search over the n-gram LM's words, scored by it); the beam ones need
        flashlight-text; or joint (a CTC/attention beam search, the model's attention decoder scoring
        each extension with its CTC prefix probability; model.attention_decoder_layers)
    beam_size: hypotheses the beam decoders keep
    word_score: added per emitted word by the beam decoders (> 0 favours more, shorter words)
    num_buckets: most length buckets per epoch; a compiled model sees only their boundaries as lengths
    tokenizer: chars (letters, apostrophe, space), or bpe / unigram subwords learned from the training
        transcripts (saved with the run); with subwords the model's output size is the vocabulary's
    vocab_size: most subword ids (blank and <unk> included), for tokenizer=bpe/unigram
    lm: an ARPA n-gram file for decoder=beam_lm (e.g. KenLM's lmplz output); unset: one is built
    lm_text: a text file (a sentence a line) the beam_lm n-gram is built from; unset: the training
        transcripts
    lm_order: n of the n-gram built for beam_lm (interpolated Kneser-Ney)
    lm_weight: beam_lm's weight on the LM's natural-log word probabilities
    batch_duration: seconds of audio per batch (padding counted, NeMo's/Lhotse's batch_duration),
        in place of trainer.batch_size's fixed count; 0: off
    ctc_weight: with an attention decoder, the training loss is ctc_weight * CTC + (1 - ctc_weight) *
        the decoder's cross-entropy (ignored by a CTC-only model)
    label_smoothing: label smoothing of the attention decoder's cross-entropy
    decode_ctc_weight: weight of the CTC prefix score in task.decoder=joint (1 - it: the decoder's)
    """

    primary_metric = "val/wer"
    throughput_unit = "audio_s"
    data_type = tuple[SpeechDataset, SpeechDataset]
    maximize = False
    prediction_format = "jsonl"
    # Compiled, Inductor recompiles the Conformer's convolutions for every new time length even when marked
    # dynamic: bucket boundaries (10 ms frames = feature frames) leave at most num_buckets lengths, padding
    # masked by `feature_lengths`. Time stays static, else dynamo's first dynamic-time attempt costs a compile
    # Inductor undoes. Training batches all have batch_size examples (the trainer tops up short ones when
    # compiling); evaluation's last batches are short, so the batch dim is symbolic there from the start.
    shape_hints = ShapeHints(
        bucket_pad={"features": 1},
        static={"features": (1,)},
        eval_dynamic={"features": (0,), "feature_lengths": (0,)},
    )

    def __init__(
        self,
        *,
        model: Mapping[str, Any],
        data: Mapping[str, Any],
        spec_augment: bool = True,
        freq_masks: Annotated[int, Bounds(ge=0)] = 2,
        freq_width: Annotated[int, Bounds(ge=0)] = 15,
        time_masks: Annotated[int, Bounds(ge=0)] = 2,
        time_width: Annotated[int, Bounds(ge=0)] = 20,
        freq_warp: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        speed_perturb: Annotated[tuple[float, ...], Bounds(ge=0.5, le=2)] = (0.9, 1.0, 1.1),
        noise_prob: Annotated[float, Bounds(ge=0, le=1)] = 0.0,
        noise_snr: Annotated[tuple[float, float], Bounds(ge=-20, le=80, length=2)] = (5.0, 20.0),
        reverb_prob: Annotated[float, Bounds(ge=0, le=1)] = 0.0,
        reverb_rt60: Annotated[tuple[float, float], Bounds(gt=0, le=3, length=2)] = (0.2, 0.6),
        decoder: Annotated[str, Bounds(choices=DECODERS)] = "greedy",
        beam_size: Annotated[int, Bounds(ge=1)] = 8,
        word_score: float = 0.0,
        num_buckets: Annotated[int, Bounds(ge=1)] = 8,
        tokenizer: Annotated[str, Bounds(choices=TOKENIZERS)] = "chars",
        vocab_size: Annotated[int, Bounds(ge=30)] = 256,
        lm: str | None = None,
        lm_text: str | None = None,
        lm_order: Annotated[int, Bounds(ge=1)] = 3,
        lm_weight: float = 0.5,
        batch_duration: Annotated[float, Bounds(ge=0)] = 0.0,
        ctc_weight: Annotated[float, Bounds(ge=0, le=1)] = 0.3,
        label_smoothing: Annotated[float, Bounds(ge=0, lt=1)] = 0.1,
        decode_ctc_weight: Annotated[float, Bounds(ge=0, le=1)] = 0.3,
    ) -> None:
        """`model`/`data` are config sections: `name` plus the registered builder's keyword arguments."""
        self.model_cfg, self.data_cfg = _checked_sections(model, data, num_buckets, tokenizer, batch_duration)
        self.decoding = Decoding(
            decoder,
            beam_size=beam_size,
            word_score=word_score,
            lm=lm,
            lm_text=lm_text,
            lm_order=lm_order,
            lm_weight=lm_weight,
            ctc_weight=decode_ctc_weight,
            read_data=self.build_datasets,
            source_texts=lambda: [c.text for c in self._source_datasets()[0].clips],
        )
        self.sample_rate = int(self.data_cfg.get("sample_rate", 16_000))
        self.front_end = FrontEnd(
            self.sample_rate,
            spec_augment=spec_augment,
            masks=(freq_masks, freq_width, time_masks, time_width),
            freq_warp=freq_warp,
            noise=(noise_prob, noise_snr),
            reverb=(reverb_prob, reverb_rt60),
        )
        self.num_buckets, self.batch_duration = num_buckets, batch_duration
        self.decoder, self.ctc_weight, self.label_smoothing = decoder, ctc_weight, label_smoothing
        self._fits: tuple[int, int] | None = None  # a seq2seq model's longest (samples, target tokens)
        self.pretrained_sizes: dict[str, Any] = {}  # what the model took from its weights file's config
        self.tokenizer_kind, self.vocab_size = tokenizer, vocab_size
        # subwords are learned from the training transcripts: in build_model (or load_artifacts) first
        self.tokenizer: CharTokenizer | SubwordTokenizer | WhisperTokenizer | None = (
            CharTokenizer() if tokenizer == "chars" else None
        )
        self._source: tuple[SpeechDataset, SpeechDataset] | None = None
        self.speed_perturb = tuple(float(f) for f in speed_perturb)
        self._out_lengths: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._scored: UtteranceScores | None = None  # the last evaluation's, for `evaluated_utterances`
        if self.data_cfg["name"] in ("espeak_words", "voices"):
            self.loader_workers = 0  # short 16-bit WAVs read faster in-process than through worker IPC

    @property
    def features(self) -> LogMel | None:
        """The log-mel front end of a model on features (None before one is built, or for one on audio)."""
        return self.front_end.features

    @property
    def lexicon(self) -> Lexicon | None:
        """The training words the lexicon decoders read."""
        return self.decoding.lexicon

    @property
    def lm(self) -> NGramLM | None:
        """The n-gram LM task.decoder=beam_lm decodes with."""
        return self.decoding.lm

    def _source_datasets(self) -> tuple[SpeechDataset, SpeechDataset]:
        """The data section's (train, validation) datasets, read once (subwords need them first)."""
        if self._source is None:
            self._source = DATASETS.build_section(self.data_cfg)
        return self._source

    def _require_tokenizer(self) -> CharTokenizer | SubwordTokenizer | WhisperTokenizer:
        """The tokenizer, learning the subword vocabulary from the training transcripts if not loaded."""
        if self.tokenizer is None:
            texts = [c.text for c in self._source_datasets()[0].clips]
            self.tokenizer = make_tokenizer(self.tokenizer_kind, self.vocab_size, texts)
            n = len(self.tokenizer)
            log.info(
                "tokenizer=%s: %d subword ids learned from the training transcripts", self.tokenizer_kind, n
            )
        return self.tokenizer

    def build_model(self) -> nn.Module:
        """The configured speech model: a CTC head sized to the tokenizer (with subwords, to the vocabulary);
        a sequence-to-sequence model's own tokenizer and decoder replace the task's."""
        cfg = self.model_cfg
        model_class = registered_class(MODELS.get(cfg["name"]))
        self.decoding.check(model_class, cfg["name"], self.tokenizer_kind)
        if not model_class.seq2seq and isinstance(self._require_tokenizer(), SubwordTokenizer):
            cfg = {**cfg, "vocab_size": len(self.tokenizer)}
            log.info("CTC head: %d outputs, the %s vocabulary", len(self.tokenizer), self.tokenizer_kind)
        model = MODELS.build_section(cfg)
        net = asr_model(model)
        self.pretrained_sizes = dict(net.file_sizes)
        self.front_end.features = None if net.takes_audio else LogMel(self.sample_rate, net.n_mels)
        if net.seq2seq:
            self.tokenizer, self._out_lengths = net.tokenizer, None
            self._fits = (net.max_samples, net.max_tokens)
            return model
        check_ctc_head(net, len(self.tokenizer))
        self._out_lengths = net.out_lengths
        self.decoding.check(net, cfg["name"], self.tokenizer_kind)
        return model

    def output_frames(self, samples: int) -> int:
        """Frames the built model outputs for a waveform of `samples` samples."""
        assert self._out_lengths is not None, "build_model() comes first"
        if self.features is None:  # a raw-audio model counts its frames from samples
            return int(self._out_lengths(torch.tensor(samples)))
        return int(self._out_lengths(self.features.frames(torch.tensor(samples))))

    def callbacks(self) -> list[Callback]:
        """The optimizer step, told to models that act on it (a pretrained encoder frozen for its first
        steps)."""
        return [UpdateCounter()]

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, validation) speech datasets, training clips speed-perturbed if asked; the training
        transcripts' words become the lexicon."""
        train, val = self._source_datasets()
        tokenizer = self._require_tokenizer()
        train, val = (
            SpeechDataset(
                ds.clips,
                sample_rate=ds.sample_rate,
                bad=ds.bad,
                speed_perturb=perturb,
                tokenizer=tokenizer,
                window_shards=ds.window_shards,
            )
            for ds, perturb in ((train, self.speed_perturb), (val, ()))
        )
        if self._out_lengths is not None:  # known once the model is built (the trainer builds it first)
            train, val = (without_unalignable(ds, self.output_frames) for ds in (train, val))
        if self._fits is not None:
            train, val = (without_unfit(ds, *self._fits) for ds in (train, val))
        lexicon = Lexicon(w for clip in train.clips for w in clip.text.split())
        lm = None
        if self.decoder == "beam_lm" and self.lm is None:
            lm = self.decoding.language_model([c.text for c in train.clips])
        self.decoding.use(lexicon, lm)  # a lexicon-constrained decoder is rebuilt on the new word list
        return train, val

    def save_artifacts(self, run_dir: Path) -> None:
        """tokenizer.json and pretrained_sizes.json (`audio.asr_run_files`); lexicon.txt: the training
        transcripts' words, which the lexicon decoders need at inference; lm.arpa: beam_lm's n-gram."""
        save_model_files(run_dir, self.tokenizer, self.pretrained_sizes)
        self.decoding.save(run_dir)

    def load_artifacts(self, run_dir: Path) -> None:
        """Take the word list, tokenizer, n-gram and pretrained sizes from `run_dir` (text files: nothing
        runs); runs from before they were saved rebuild them from the data. The run's own weights replace
        any pretrained ones, so its `model.weights` file is not read again (it may be on another machine)."""
        model_class = registered_class(MODELS.get(self.model_cfg["name"]))
        self.model_cfg = saved_model_config(run_dir, self.model_cfg, model_class)
        self.decoding.load(run_dir)
        if (tokenizer := saved_tokenizer(run_dir, self.tokenizer_kind)) is not None:
            self.tokenizer = tokenizer

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """Pad waveforms and character targets."""
        return collate_speech

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> LengthBucketBatchSampler | ShardWindowBatchSampler:
        """Batches of similar duration (`audio.shards.speech_batches`; task.batch_duration), a window of
        shards at a time for clips in shards."""
        return speech_batches(
            dataset,
            batch_size,
            train=train,
            seed=seed,
            num_buckets=self.num_buckets,
            batch_duration=self.batch_duration,
        )

    def on_device(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Waveforms -> the model's inputs (`audio.asr_frontend.FrontEnd`, augmented while training)."""
        return self.front_end(model, batch)

    def _forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        return asr_loss(model, batch, self.tokenizer.blank, self.ctc_weight, self.label_smoothing)

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """The model's loss (`audio.asr_loss`: CTC, joint CTC/attention with its two terms as metrics, or
        seq2seq cross-entropy); `padding`: the share of the batch's feature frames (or samples) that is
        padding (train/padding in the log)."""
        loss, _, _, parts = self._forward(model, batch)
        inputs, lengths = model_inputs(batch)  # feature frames, or samples for a model on raw audio
        # per utterance the padded share of its row, averaged: the trainer weighs it by utterances, so the
        # logged window mean is per utterance too
        padding = 1 - lengths.sum() / (lengths.numel() * inputs.shape[1])
        return StepOutput(
            loss=loss, count=int(batch["targets"].shape[0]), metrics={**parts, "padding": padding.detach()}
        )

    def throughput_units(self, batch: dict[str, torch.Tensor]) -> float:
        """Seconds of audio (before padding) in the batch."""
        return float(batch["audio_lengths"].sum()) / self.sample_rate

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        """Utterances: torch's mean CTC divides each utterance's loss by its target length, then averages
        over the batch, so each utterance weighs the same however many characters it holds."""
        return int(batch["target_lengths"].numel())

    def decode(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Transcripts of (B, T, V) log-probabilities with the configured decoder."""
        return self.decoding.decode(log_probs, lengths, self.tokenizer)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """Loss, WER and CER over `batches` (pooled over all words/characters), raw and after Whisper's
        English normaliser (wer_normalized, cer_normalized: `audio.scoring`); plain greedy WER/CER too when
        another decoder is configured, so its gain is visible; a joint model's two loss terms too."""
        scores = Scores(greedy_too=self.decoder != "greedy")
        for batch in batches:
            batch = self.on_device(model, batch)
            loss, log_probs, lengths, parts = self._forward(model, batch)
            hyps = self.decoding.hypotheses(model, batch, log_probs, lengths, self.tokenizer)
            scores.add(batch, hyps, log_probs, lengths, self.tokenizer, loss, parts)
        self._scored = scores.utterances
        return scores.result()

    def write_utterances(self, path: Path, dataset: SpeechDataset, order: Sequence[int]) -> dict[str, int]:
        """The last `evaluate`'s utterances as JSON lines in `path` (`UtteranceScores.write`)."""
        assert self._scored is not None, "evaluate() comes first"
        return self._scored.write(path, order, dataset.describe)

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Waveforms and their lengths in (the front end is part of the export, so a caller needs no feature
        code); CTC log-probabilities and frame counts, or a seq2seq model's encoder output, out
        (`audio.asr_export`)."""
        return asr_export.export_inputs(model, batch, length, self.sample_rate, self.tokenizer)

    def export_parts(
        self, model: nn.Module, batch: Any, *, length: int | None = None
    ) -> dict[str, ExportInputs]:
        """With an attention decoder (or a sequence-to-sequence model's own), `decoder`: its teacher-forced
        logits over the main program's encoder output."""
        return asr_export.export_parts(model, lambda: self.export_inputs(model, batch, length=length), batch)

    @torch.no_grad()
    def transcribe(self, model: nn.Module, wav: torch.Tensor, sample_rate: int) -> str:
        """Transcript of one mono waveform (S,) at `sample_rate`."""
        return self.transcribe_batch(model, [resampled(wav, sample_rate, self.sample_rate)])[0]

    @torch.no_grad()
    def transcribe_batch(self, model: nn.Module, wavs: Sequence[torch.Tensor]) -> list[str]:
        """Transcripts of mono waveforms (S,) at the task's sample rate, run as one zero-padded batch."""
        batch = self.on_device(model, waveform_batch(wavs, next(model.parameters()).device))
        return self.decoding.transcripts(model, batch, self.tokenizer)

    def prediction_inputs(self, source: Path) -> list[AudioInput]:
        """An audio file, every audio file under a folder, or a JSONL manifest's rows (with references)."""
        return utterances(source)

    def predict(self, model: nn.Module, items: Sequence[AudioInput]) -> list[dict[str, Any]]:
        """Each file's transcript by the configured decoder (`task.decoder`), with its reference if given."""
        texts = self.transcribe_batch(model, [read_audio(u.path, self.sample_rate) for u in items])
        return [
            {"path": str(u.path), "text": t, **({} if u.reference is None else {"reference": u.reference})}
            for u, t in zip(items, texts, strict=True)
        ]

    def prediction_summary(
        self, items: Sequence[AudioInput], rows: Sequence[dict[str, Any]]
    ) -> dict[str, float]:
        """WER and CER (pooled, as validation computes them) over the items a manifest gave references."""
        return scores(items, rows)
