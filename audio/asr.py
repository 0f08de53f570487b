"""The speech-recognition task: Conformer-CTC over characters or subwords, scored by WER and CER."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import audio.conformer  # noqa: F401 - registers the conformer_ctc_* models
import audio.datasets  # noqa: F401 - registers the speech datasets
import audio.wav2vec2  # noqa: F401 - registers the wav2vec2/hubert/wavlm_ctc models
import audio.whisper  # noqa: F401 - registers the whisper model
from audio.augment import AddNoise, Reverb
from audio.ctc import (
    TOKENIZERS,
    BeamSearchDecoder,
    CharTokenizer,
    Lexicon,
    SubwordTokenizer,
    edit_counts,
    error_rates,
    greedy_decode,
    make_tokenizer,
    normalize_transcript,
    require_beam_search,
    require_lm_decoding,
)
from audio.datasets import (
    SpeechDataset,
    audio_files,
    collate_speech,
    manifest_rows,
    read_audio,
    without_unalignable,
    without_unfit,
)
from audio.features import FrequencyWarp, LogMel, SpecAugment
from audio.joint_decoding import joint_beam_search
from audio.ngram import NGramLM, kneser_ney, read_sentences
from audio.wav2vec2 import SIZE_KEYS as WAV2VEC2_SIZE_KEYS
from audio.wav2vec2 import UpdateCounter, saved_sizes
from audio.whisper import SIZE_KEYS as WHISPER_SIZE_KEYS
from audio.whisper import WhisperTokenizer
from core.bounds import Bounds
from core.compile.state_dict import unwrap
from core.data.samplers import LengthBucketBatchSampler
from core.errors import ConfigError, DataError, unknown_choice
from core.files import write_text_atomic
from core.loop.callbacks import Callback
from core.loop.task import ExportInputs, ShapeHints, StepOutput, Task, batch_dim
from core.registry import DATASETS, MODELS, TASKS

log = logging.getLogger(__name__)


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


def _takes_audio(model: nn.Module) -> bool:
    """Whether `model` runs on waveforms (a pretrained speech encoder) rather than the task's log-mel
    features."""
    inner = getattr(model, "module", model)  # DistributedDataParallel's wrapped model
    return bool(getattr(inner, "takes_audio", False))


def _inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's two inputs from a batch `on_device` prepared: features or waveforms, with lengths."""
    if "features" in batch:
        return batch["features"], batch["feature_lengths"]
    return batch["audio"], batch["audio_lengths"]


#: the training words, saved in the run directory for the lexicon decoders at inference
LEXICON_FILE = "lexicon.txt"
#: a subword tokenizer learned from the training transcripts (the `tokenizers` library's JSON)
TOKENIZER_FILE = "tokenizer.json"
#: the n-gram LM task.decoder=beam_lm decodes with (ARPA text)
LM_FILE = "lm.arpa"
#: the sizes a pretrained file's own config gave the model (JSON): the run's checkpoints are of that shape
PRETRAINED_SIZES_FILE = "pretrained_sizes.json"
#: task.decoder values; the beam ones need flashlight-text (the `speech` extra), joint an attention decoder
DECODERS = ("greedy", "lexicon", "beam", "beam_lexicon", "beam_lm", "joint")
#: the attention decoder's <sos> and <eos>: the CTC blank's id, which is never a label
SOS = EOS = CharTokenizer.blank
#: what `recipes.predict input=` takes as a manifest rather than an audio file
MANIFEST_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Utterance:
    """One audio file to transcribe, with its reference transcript (normalized) when a manifest gives one."""

    path: Path
    reference: str | None = None


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


@TASKS.register("asr")
class ASRTask(Task):
    """Character CTC speech recognition scored by WER and CER; speed perturbation runs as clips are read,
    noise, reverberation, features and SpecAugment on the training device."""

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
        """`model`/`data` are config sections: `name` plus the registered builder's keyword arguments.

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
        self.model_cfg, self.data_cfg = _plain(model), _plain(data)
        for kind, cfg in (("model", self.model_cfg), ("data", self.data_cfg)):
            if "name" not in cfg:
                raise ConfigError(f"the {kind} config has no 'name'; pick one with {kind}=NAME")
        DATASETS.check_section(self.data_cfg)  # e.g. data.on_bad_sample's value, before any data is read
        if decoder not in DECODERS:
            raise unknown_choice("task.decoder", decoder, DECODERS)
        _at_least("task.beam_size", beam_size, 1)
        _at_least("task.num_buckets", num_buckets, 1)
        for key, (lo, hi) in (("noise_snr", noise_snr), ("reverb_rt60", reverb_rt60)):
            if lo > hi:
                raise ConfigError(
                    f"task.{key}=[{lo},{hi}] is not [lowest,highest]; swap the two values",
                    key=f"task.{key}",
                    value=f"[{lo},{hi}]",
                    valid=("[lowest,highest]",),
                )
        if tokenizer not in TOKENIZERS:
            raise unknown_choice("task.tokenizer", tokenizer, TOKENIZERS)
        _at_least("task.batch_duration", batch_duration, 0, " (0: off)")
        self.num_buckets, self.batch_duration = num_buckets, batch_duration
        if decoder == "beam_lm":
            require_lm_decoding()
        elif decoder.startswith("beam"):
            require_beam_search()  # before training, not at the first evaluation
        self.decoder, self.beam_size, self.word_score = decoder, beam_size, word_score
        self.lm_path, self.lm_text, self.lm_order, self.lm_weight = lm, lm_text, lm_order, lm_weight
        self.ctc_weight, self.label_smoothing = ctc_weight, label_smoothing
        self.decode_ctc_weight = decode_ctc_weight
        self.attention = False  # the built model has an attention decoder (known in build_model)
        self.seq2seq = False  # the built model is a sequence-to-sequence one with its own tokenizer (Whisper)
        self._fits: tuple[int, int] | None = None  # a seq2seq model's longest (samples, target tokens)
        self._beam: BeamSearchDecoder | None = None
        self.lexicon: Lexicon | None = None
        self.lm: NGramLM | None = None
        self.pretrained_sizes: dict[str, Any] = {}  # what the model took from its weights file's config
        self.tokenizer_kind, self.vocab_size = tokenizer, vocab_size
        # subwords are learned from the training transcripts: in build_model (or load_artifacts) first
        self.tokenizer: CharTokenizer | SubwordTokenizer | WhisperTokenizer | None = (
            CharTokenizer() if tokenizer == "chars" else None
        )
        self._source: tuple[SpeechDataset, SpeechDataset] | None = None
        self.sample_rate = int(self.data_cfg.get("sample_rate", 16_000))
        self.augment = SpecAugment(freq_masks, freq_width, time_masks, time_width) if spec_augment else None
        self.warp = FrequencyWarp(freq_warp)
        self.speed_perturb = tuple(float(f) for f in speed_perturb)
        self.noise = AddNoise(noise_prob, noise_snr)
        self.reverb = Reverb(reverb_prob, reverb_rt60, self.sample_rate)
        self.features: LogMel | None = None
        self._out_lengths: Callable[[torch.Tensor], torch.Tensor] | None = None
        if self.data_cfg["name"] in ("espeak_words", "voices"):
            self.loader_workers = 0  # short 16-bit WAVs read faster in-process than through worker IPC

    def _source_datasets(self) -> tuple[SpeechDataset, SpeechDataset]:
        """The data section's (train, validation) datasets, read once (subwords need them first)."""
        if self._source is None:
            self._source = DATASETS.build_section(self.data_cfg)
        return self._source

    def _require_tokenizer(self) -> CharTokenizer | SubwordTokenizer:
        """The tokenizer, learning the subword vocabulary from the training transcripts if not loaded."""
        if self.tokenizer is None:
            texts = [c.text for c in self._source_datasets()[0].clips]
            self.tokenizer = make_tokenizer(self.tokenizer_kind, self.vocab_size, texts)
            log.info(
                "tokenizer=%s: %d subword ids learned from the training transcripts",
                self.tokenizer_kind,
                len(self.tokenizer),
            )
        return self.tokenizer

    def build_model(self) -> nn.Module:
        """The configured acoustic model (Conformer-CTC on log-mel features, or a pretrained encoder on raw
        audio); its vocabulary must match the character tokenizer (with subwords, its output size is set to
        the vocabulary's)."""
        if self.model_cfg["name"] == "whisper":
            return self._build_seq2seq()
        tokenizer = self._require_tokenizer()
        cfg = self.model_cfg
        if isinstance(tokenizer, SubwordTokenizer):
            cfg = {**cfg, "vocab_size": len(tokenizer)}
            log.info("CTC head: %d outputs, the %s vocabulary", len(tokenizer), self.tokenizer_kind)
        model = MODELS.build_section(cfg)
        if getattr(model, "vocab_size", len(self.tokenizer)) != len(self.tokenizer):
            raise ConfigError(
                f"model.vocab_size={model.vocab_size} but the character vocabulary has "
                f"{len(self.tokenizer)} symbols; set model.vocab_size={len(self.tokenizer)}",
                key="model.vocab_size",
                value=str(model.vocab_size),
                valid=(str(len(self.tokenizer)),),
            )
        self.pretrained_sizes = dict(getattr(model, "file_sizes", {}))
        self.features = None if _takes_audio(model) else LogMel(self.sample_rate, model.n_mels)
        self._out_lengths = getattr(model, "out_lengths", None)
        self.attention = getattr(model, "attention_decoder", None) is not None
        if self.decoder == "joint" and not self.attention:
            raise ConfigError(
                "task.decoder=joint needs an attention decoder; set model.attention_decoder_layers=N (N > 0)",
                key="task.decoder",
                value="joint",
                valid=("model.attention_decoder_layers>=1",),
            )
        return model

    def _build_seq2seq(self) -> nn.Module:
        """A sequence-to-sequence model (Whisper): its own tokenizer replaces the task's, and it decodes with
        its own decoder, so the CTC decoders and subword settings do not apply."""
        for key, value, default in (
            ("task.decoder", self.decoder, "greedy"),
            ("task.tokenizer", self.tokenizer_kind, "chars"),
        ):
            if value != default:
                raise ConfigError(
                    f"{key}={value} is a CTC setting; model={self.model_cfg['name']} decodes with its own "
                    f"tokenizer and decoder (greedy): drop {key}",
                    key=key,
                    value=value,
                    valid=(default,),
                )
        model = MODELS.build_section(self.model_cfg)
        self.tokenizer, self.seq2seq = model.tokenizer, True
        self.pretrained_sizes = dict(model.file_sizes)
        self.features, self._out_lengths = None, None
        self._fits = (model.max_samples, model.max_tokens)
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
                ds.clips, sample_rate=ds.sample_rate, bad=ds.bad, speed_perturb=perturb, tokenizer=tokenizer
            )
            for ds, perturb in ((train, self.speed_perturb), (val, ()))
        )
        if self._out_lengths is not None:  # known once the model is built (the trainer builds it first)
            train, val = (
                without_unalignable(train, self.output_frames),
                without_unalignable(val, self.output_frames),
            )
        if self._fits is not None:
            train, val = (without_unfit(ds, *self._fits) for ds in (train, val))
        self.lexicon = Lexicon(w for clip in train.clips for w in clip.text.split())
        if self.decoder == "beam_lm" and self.lm is None:
            self.lm = self._language_model(train)
        self._beam = None  # a lexicon-constrained decoder is rebuilt on the new word list
        return train, val

    def _language_model(self, train: SpeechDataset | None) -> NGramLM:
        """task.lm's ARPA file, else an n-gram built from task.lm_text or the training transcripts (`train`;
        None: read from the data)."""
        if self.lm_path:
            return NGramLM.from_arpa(self.lm_path)
        if self.lm_text:
            return kneser_ney(read_sentences(self.lm_text), self.lm_order)
        train = self._source_datasets()[0] if train is None else train
        return kneser_ney([c.text.split() for c in train.clips], self.lm_order)

    def save_artifacts(self, run_dir: Path) -> None:
        """lexicon.txt: the training transcripts' words, which the lexicon decoders need at inference;
        tokenizer.json: a subword vocabulary; lm.arpa: beam_lm's n-gram; pretrained_sizes.json: the sizes a
        pretrained file's config set."""
        if self.pretrained_sizes:  # JSON writes the conv layers' tuples as lists, which the model takes
            write_text_atomic(run_dir / PRETRAINED_SIZES_FILE, json.dumps(self.pretrained_sizes) + "\n")
        if self.lexicon is not None:
            write_text_atomic(run_dir / LEXICON_FILE, "".join(f"{w}\n" for w in self.lexicon.words))
        if isinstance(self.tokenizer, SubwordTokenizer):
            write_text_atomic(run_dir / TOKENIZER_FILE, self.tokenizer.to_json())
        elif isinstance(self.tokenizer, WhisperTokenizer):  # the run's own copy: eval needs no weights folder
            write_text_atomic(run_dir / TOKENIZER_FILE, self.tokenizer.json)
        if self.lm is not None:
            self.lm.save(run_dir / LM_FILE)

    def load_artifacts(self, run_dir: Path) -> None:
        """Take the word list, subword vocabulary and n-gram from `run_dir` (text files: nothing runs); runs
        from before they were saved rebuild them from the data. The run's own weights replace any pretrained
        ones, so its `model.weights` file is not read again (it may be on another machine by now)."""
        whisper = self.model_cfg["name"] == "whisper"
        if self.model_cfg.pop("weights", None):
            keys = WHISPER_SIZE_KEYS if whisper else WAV2VEC2_SIZE_KEYS
            self.model_cfg.update(saved_sizes(run_dir / PRETRAINED_SIZES_FILE, keys))
        if whisper:
            self.model_cfg.pop("sha256", None)
            if (run_dir / TOKENIZER_FILE).is_file():
                self.model_cfg["tokenizer"] = str(run_dir / TOKENIZER_FILE)
        path = run_dir / LEXICON_FILE
        if path.is_file():
            self.lexicon = Lexicon(path.read_text().split())
            self._beam = None
        if self.tokenizer_kind != "chars" and (run_dir / TOKENIZER_FILE).is_file():
            self.tokenizer = SubwordTokenizer.from_json((run_dir / TOKENIZER_FILE).read_text())
        if self.decoder == "beam_lm" and (run_dir / LM_FILE).is_file():
            self.lm = NGramLM.from_arpa(run_dir / LM_FILE)
            self._beam = None

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """Pad waveforms and character targets."""
        return collate_speech

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, train: bool, seed: int
    ) -> LengthBucketBatchSampler:
        """Batches of similar duration (shuffled for training), bucketed on 10 ms frames: `batch_size` clips
        each, or with task.batch_duration=S as many as keep clips x the longest within S seconds."""
        frames = [int(d * 100) + 1 for d in dataset.durations]  # rounded up: the budget is never exceeded
        if not self.batch_duration:
            # at least ~4 batches per bucket: on a small set, 8 buckets would cut batches down to a few clips
            buckets = max(1, min(self.num_buckets, len(frames) // (4 * batch_size)))
            return LengthBucketBatchSampler(frames, batch_size, shuffle=train, seed=seed, num_buckets=buckets)
        budget = int(self.batch_duration * 100)
        longer = sum(n > budget for n in frames)
        if longer:
            log.info(
                "task.batch_duration=%g: %d clips longer than that are a batch each",
                self.batch_duration,
                longer,
            )
        per_batch = max(1, budget // max(1, sorted(frames)[len(frames) // 2]))  # clips of median length
        buckets = max(1, min(self.num_buckets, len(frames) // (4 * per_batch)))
        # trainer.batch_size does not cap the count: the duration decides it
        return LengthBucketBatchSampler(
            frames, max(1, len(frames)), shuffle=train, seed=seed, num_buckets=buckets, max_padded=budget
        )

    def on_device(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Waveforms -> log-mel features (while training: reverberation and noise first if enabled, then
        the features frequency-warped and SpecAugment if enabled)."""
        if "features" in batch:
            return batch
        if _takes_audio(model):  # its own front end; masking is the model's, in training mode
            if model.training:
                audio, lengths = batch["audio"], batch["audio_lengths"]
                batch = {**batch, "audio": self.noise(self.reverb(audio, lengths), lengths)}
            return batch
        if self.features is None:
            self.features = LogMel(self.sample_rate, model.n_mels)
        self.features = self.features.to(batch["audio"].device)
        audio, audio_lengths = batch["audio"], batch["audio_lengths"]
        if model.training:
            # noise after reverberation, so the noise itself is not reverberated (as a microphone's is not)
            audio = self.noise(self.reverb(audio, audio_lengths), audio_lengths)
        feats, lengths = self.features(audio, audio_lengths)
        if model.training:
            feats = self.warp(feats)
            if self.augment is not None:
                feats = self.augment(feats)
        out = {k: v for k, v in batch.items() if k not in ("audio", "audio_lengths")}
        out |= {"features": feats, "feature_lengths": lengths}
        return out

    def _forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.seq2seq:
            return self._seq2seq_forward(model, batch)
        if self.attention:
            return self._joint_forward(model, batch)
        log_probs, lengths = model(*_inputs(batch))
        return self._ctc_loss(log_probs, lengths, batch), log_probs, lengths, {}

    def _ctc_loss(
        self, log_probs: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return F.ctc_loss(
            log_probs.transpose(0, 1).float(),
            batch["targets"],
            lengths,
            batch["target_lengths"],
            blank=self.tokenizer.blank,
            zero_infinity=True,  # an utterance too fast for its frames must not poison the batch with inf
        )

    def _joint_forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """ctc_weight * CTC + (1 - ctc_weight) * the decoder's label-smoothed cross-entropy, teacher-forced
        on <sos> + labels -> labels + <eos>; each utterance's cross-entropy is a mean over its tokens, as
        torch's CTC mean is over its characters, so both weigh every utterance the same."""
        targets, n = batch["targets"], batch["target_lengths"]
        first = torch.full_like(targets[:, :1], SOS)
        inputs = torch.cat([first, targets], 1)
        pos = torch.arange(inputs.shape[1], device=targets.device)[None, :]
        outputs = torch.cat([targets, first], 1)
        outputs = outputs.masked_fill(pos == n[:, None], EOS).masked_fill(pos > n[:, None], -100)
        # padded inputs after each <eos> are masked from the real positions by causality: no token mask
        log_probs, lengths, logits = model(batch["features"], batch["feature_lengths"], inputs)
        ce = F.cross_entropy(
            logits.float().transpose(1, 2), outputs, label_smoothing=self.label_smoothing, reduction="none"
        )
        ce = (ce.sum(1) / (n + 1)).mean()
        ctc = self._ctc_loss(log_probs, lengths, batch)
        loss = self.ctc_weight * ctc + (1 - self.ctc_weight) * ce
        return loss, log_probs, lengths, {"ctc_loss": ctc.detach(), "attention_loss": ce.detach()}

    def _seq2seq_forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        """A sequence-to-sequence model's teacher-forced cross-entropy: prompt + tokens -> tokens + <end>,
        each utterance's a mean over its tokens (as CTC's is over its labels), averaged over the batch."""
        net = unwrap(model)
        targets, n = batch["targets"], batch["target_lengths"]
        prompt = net.prompt(targets.shape[0], targets.device)
        inputs = torch.cat([prompt, targets], 1)
        p = prompt.shape[1]
        pos = torch.arange(targets.shape[1] + 1, device=targets.device)[None, :]
        outputs = torch.cat([targets, targets[:, :1]], 1)
        outputs = outputs.masked_fill(pos == n[:, None], net.tokenizer.eot).masked_fill(
            pos > n[:, None], -100
        )
        logits = model(batch["audio"], batch["audio_lengths"], inputs)[:, p - 1 :]
        ce = F.cross_entropy(logits.float().transpose(1, 2), outputs, reduction="none")
        return (ce.sum(1) / (n + 1)).mean(), None, None, {}

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """CTC loss (per target character, averaged over the batch); with an attention decoder the joint
        loss, its two terms as metrics (ctc_loss, attention_loss); `padding`: the share of the batch's
        feature frames (or samples) that is padding (train/padding in the log)."""
        loss, _, _, parts = self._forward(model, batch)
        inputs, lengths = _inputs(batch)  # feature frames, or samples for a model on raw audio
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
        if self.decoder.startswith("beam"):
            if self._beam is None:
                words = None
                if self.decoder == "beam_lexicon":
                    if self.lexicon is None:
                        self.build_datasets()  # e.g. transcribing after training: words come from the data
                    words = self.lexicon.words
                if self.decoder == "beam_lm" and self.lm is None:
                    self.lm = self._language_model(None)  # a run trained without beam_lm saved none
                self._beam = BeamSearchDecoder(
                    self.tokenizer,
                    self.beam_size,
                    words,
                    self.word_score,
                    lm=self.lm if self.decoder == "beam_lm" else None,
                    lm_weight=self.lm_weight,
                )
            return self._beam(log_probs, lengths)
        greedy = [
            self.tokenizer.decode(ids) for ids in greedy_decode(log_probs, lengths, self.tokenizer.blank)
        ]
        if self.decoder == "lexicon":
            if self.lexicon is None:
                self.build_datasets()  # e.g. transcribing after training: the lexicon comes from the data
            return [self.lexicon.correct(h) for h in greedy]
        return greedy

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """Loss, WER and CER over `batches` (pooled over all words/characters); plain greedy WER/CER too when
        another decoder is configured, so its gain is visible; a joint model's two loss terms too."""
        loss_sum, n = 0.0, 0
        part_sums: dict[str, float] = {}  # a joint model's ctc_loss and attention_loss
        zero = {"word_errors": 0, "words": 0, "char_errors": 0, "chars": 0}
        counts, greedy_counts = dict(zero), dict(zero)
        for batch in batches:
            batch = self.on_device(model, batch)
            loss, log_probs, lengths, parts = self._forward(model, batch)
            refs = [
                self.tokenizer.decode(t[:m].tolist())
                for t, m in zip(batch["targets"].cpu(), batch["target_lengths"].tolist(), strict=True)
            ]
            for k, v in edit_counts(refs, self._hypotheses(model, batch, log_probs, lengths)).items():
                counts[k] += v
            if self.decoder != "greedy":
                greedy = greedy_decode(log_probs, lengths, self.tokenizer.blank)
                for k, v in edit_counts(refs, [self.tokenizer.decode(ids) for ids in greedy]).items():
                    greedy_counts[k] += v
            loss_sum += float(loss) * len(refs)
            for k, v in parts.items():
                part_sums[k] = part_sums.get(k, 0.0) + float(v) * len(refs)
            n += len(refs)
        out = {"loss": loss_sum / max(n, 1)} | {k: v / max(n, 1) for k, v in part_sums.items()}
        for prefix, c in (("", counts), ("greedy_", greedy_counts)):
            if prefix == "" or self.decoder != "greedy":
                out |= {f"{prefix}{k}": v for k, v in error_rates(c).items()}
        return out

    def export_inputs(self, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        """Waveforms and their lengths in, log-probabilities and frame counts out (with an attention decoder,
        the encoder's output too, which `export_parts`' decoder reads): the log-mel front end is part of the
        export (it exports cleanly to both formats), so a caller needs no feature code. Any batch size and
        any duration from the shortest the model takes; `length` cuts the waveforms short."""
        # torch.export specialises sizes 0 and 1, so a dynamic time dim must keep >= 2 frames after the
        # model's subsampling: the shortest clip is the fewest samples that leave two
        if self.seq2seq:
            return self._seq2seq_export(model, batch, length)
        if _takes_audio(model):
            wrapped, shortest = model.eval(), model.min_samples(2)
        else:
            features = LogMel(self.sample_rate, model.n_mels).to(batch["audio"].device)
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
            f"float32 mono waveforms at {self.sample_rate} Hz (resample first), zero-padded to the longest, "
            f"at least {shortest} samples, with their int64 lengths; decode the log-probabilities with CTC "
            f"(id {self.tokenizer.blank} the blank; ids from 0: {self.tokenizer.symbols!r})",
            length=audio.shape[1],
        )

    def _seq2seq_export(self, model: nn.Module, batch: Any, length: int | None) -> ExportInputs:
        """A sequence-to-sequence model's encoder program (`EncoderProgram`): waveforms up to the model's
        window in, encoder output and lengths out; its decoder is the `decoder` part."""
        net = unwrap(model).eval()
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
            f"float32 mono waveforms at {self.sample_rate} Hz (resample first), zero-padded to the longest "
            f"and on to a multiple of {step} samples, {shortest} to {net.max_samples}, with their int64 "
            "lengths; decode with the decoder program, from the prompt its description gives",
            length=audio.shape[1],
        )

    def export_parts(
        self, model: nn.Module, batch: Any, *, length: int | None = None
    ) -> dict[str, ExportInputs]:
        """With an attention decoder (or a sequence-to-sequence model's own), `decoder`: its teacher-forced
        logits over the main program's encoder output, for a caller decoding token by token (<sos> or the
        model's prompt, then each chosen token, until the end token)."""
        seq2seq = self.seq2seq
        if getattr(model, "attention_decoder", None) is None and not seq2seq:
            return {}
        main = self.export_inputs(model, batch, length=length)
        with torch.no_grad():
            if seq2seq:
                memory, frames = main.module(*main.args)
            else:
                _, frames, memory = main.module(*main.args)
        targets, n = batch["targets"], batch["target_lengths"]
        if seq2seq:
            net = unwrap(model)
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

    @torch.no_grad()
    def transcribe(self, model: nn.Module, wav: torch.Tensor, sample_rate: int) -> str:
        """Transcript of one mono waveform (S,) at `sample_rate`."""
        import torchaudio.functional as AF

        if sample_rate != self.sample_rate:
            wav = AF.resample(wav, sample_rate, self.sample_rate)
        return self.transcribe_batch(model, [wav])[0]

    @torch.no_grad()
    def transcribe_batch(self, model: nn.Module, wavs: Sequence[torch.Tensor]) -> list[str]:
        """Transcripts of mono waveforms (S,) at the task's sample rate, run as one zero-padded batch."""
        device = next(model.parameters()).device
        batch = {
            "audio": torch.nn.utils.rnn.pad_sequence(list(wavs), batch_first=True).to(device),
            "audio_lengths": torch.tensor([len(w) for w in wavs], device=device),
        }
        batch = self.on_device(model, batch)
        if self.seq2seq:
            return self._hypotheses(model, batch, None, None)
        log_probs, lengths = model(*_inputs(batch))
        return self._hypotheses(model, batch, log_probs, lengths)

    def _hypotheses(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        log_probs: torch.Tensor | None,
        lengths: torch.Tensor | None,
    ) -> list[str]:
        """Transcripts by the configured decoder; joint runs the encoder again for the decoder's memory; a
        sequence-to-sequence model decodes its own (greedy, with its KV cache)."""
        if self.seq2seq:
            ids = unwrap(model).generate(batch["audio"], batch["audio_lengths"])
            return [self.tokenizer.decode(i) for i in ids]
        if self.decoder != "joint":
            return self.decode(log_probs, lengths)
        net = unwrap(model)
        memory, frames = net.encode(batch["features"], batch["feature_lengths"])
        found = joint_beam_search(
            net.attention_decoder,
            memory,
            frames,
            log_probs,
            beam_size=self.beam_size,
            ctc_weight=self.decode_ctc_weight,
            sos=SOS,
            eos=EOS,
            blank=self.tokenizer.blank,
        )
        return [self.tokenizer.decode(ids) for ids, _ in found]

    def prediction_inputs(self, source: Path) -> list[Utterance]:
        """An audio file, every audio file under a folder, or a JSONL manifest's rows (audio_filepath, and
        text: a reference to score against, optional)."""
        if source.suffix.lower() in MANIFEST_SUFFIXES:
            rows = manifest_rows(source, need_text=False)
            if not rows:
                raise DataError(f"manifest {source} has no rows")
            return [Utterance(a, None if t is None else normalize_transcript(t)) for a, t in rows]
        return [Utterance(p) for p in audio_files(source)]

    def predict(self, model: nn.Module, items: Sequence[Utterance]) -> list[dict[str, Any]]:
        """Each file's transcript by the configured decoder (`task.decoder`), with its reference if given."""
        texts = self.transcribe_batch(model, [read_audio(u.path, self.sample_rate) for u in items])
        return [
            {"path": str(u.path), "text": t, **({} if u.reference is None else {"reference": u.reference})}
            for u, t in zip(items, texts, strict=True)
        ]

    def prediction_summary(
        self, items: Sequence[Utterance], rows: Sequence[dict[str, Any]]
    ) -> dict[str, float]:
        """WER and CER (pooled, as validation computes them) over the items a manifest gave references."""
        pairs = zip(items, rows, strict=True)
        scored = [(u.reference, r["text"]) for u, r in pairs if u.reference is not None]
        if not scored:
            return {}
        refs, hyps = zip(*scored, strict=True)
        return {**error_rates(edit_counts(refs, hyps)), "scored": len(scored)}
