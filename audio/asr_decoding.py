"""How the ASR task turns a model's output into transcripts (`task.decoder`): CTC's greedy, lexicon and
beam-search decoders (over the training words, or scored by an n-gram LM), the joint CTC/attention beam
search, or a sequence-to-sequence model's own greedy decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from audio.asr_loss import EOS, SOS, model_inputs
from audio.asr_model import ASRModel, asr_model
from audio.ctc import (
    BeamSearchDecoder,
    Lexicon,
    edit_counts,
    error_rates,
    greedy_decode,
    require_beam_search,
    require_lm_decoding,
)
from audio.joint_decoding import joint_beam_search
from audio.ngram import NGramLM, kneser_ney, read_sentences
from audio.scoring import UtteranceScores, english_normalizer
from core.errors import ConfigError, unknown_choice
from core.files import write_text_atomic

#: the training words, saved in the run directory for the lexicon decoders at inference
LEXICON_FILE = "lexicon.txt"
#: the n-gram LM task.decoder=beam_lm decodes with (ARPA text)
LM_FILE = "lm.arpa"
#: task.decoder values; the beam ones need flashlight-text (the `speech` extra), joint an attention decoder
DECODERS = ("greedy", "lexicon", "beam", "beam_lexicon", "beam_lm", "joint")


class Decoding:
    """task.decoder with its settings, and what it reads: the lexicon (the training words), the n-gram LM and
    the beam-search decoder built on them (built again when either changes)."""

    def __init__(
        self,
        decoder: str,
        *,
        beam_size: int,
        word_score: float,
        lm: str | None,
        lm_text: str | None,
        lm_order: int,
        lm_weight: float,
        ctc_weight: float,
        read_data: Callable[[], object],
        source_texts: Callable[[], list[str]],
    ) -> None:
        """`read_data()` reads the training data, which gives the lexicon (`use`) when a decoder needs the
        words and no run saved them; `source_texts()`: the training transcripts as read, for an LM."""
        if decoder not in DECODERS:
            raise unknown_choice("task.decoder", decoder, DECODERS)
        if beam_size < 1:
            raise ConfigError(
                f"task.beam_size={beam_size} must be >= 1",
                key="task.beam_size",
                value=str(beam_size),
                valid=(">= 1",),
            )
        if decoder == "beam_lm":
            require_lm_decoding()
        elif decoder.startswith("beam"):
            require_beam_search()  # before training, not at the first evaluation
        self.decoder, self.beam_size, self.word_score = decoder, beam_size, word_score
        self.lm_path, self.lm_text, self.lm_order, self.lm_weight = lm, lm_text, lm_order, lm_weight
        self.ctc_weight, self.read_data, self.source_texts = ctc_weight, read_data, source_texts
        self.lexicon: Lexicon | None = None
        self.lm: NGramLM | None = None
        self._beam: BeamSearchDecoder | None = None

    def use(self, lexicon: Lexicon | None = None, lm: NGramLM | None = None) -> None:
        """Decode with this lexicon and/or LM from now on."""
        self.lexicon = self.lexicon if lexicon is None else lexicon
        self.lm = self.lm if lm is None else lm
        self._beam = None

    def check(self, model: ASRModel | type[ASRModel], name: str, tokenizer_kind: str) -> None:
        """A ConfigError when this decoder cannot decode `model` (its class before it is built): the CTC
        settings for a sequence-to-sequence model, joint for a model without an attention decoder."""
        if model.seq2seq:
            for key, value, default in (
                ("decoder", self.decoder, "greedy"),
                ("tokenizer", tokenizer_kind, "chars"),
            ):
                if value != default:
                    raise ConfigError(
                        f"task.{key}={value} is a CTC setting; model={name} decodes with its own "
                        f"tokenizer and decoder (greedy): drop task.{key}",
                        key=f"task.{key}",
                        value=value,
                        valid=(default,),
                    )
        elif isinstance(model, ASRModel) and self.decoder == "joint" and not model.has_joint_decoder:
            raise ConfigError(
                "task.decoder=joint needs an attention decoder; set model.attention_decoder_layers=N (N > 0)",
                key="task.decoder",
                value="joint",
                valid=("model.attention_decoder_layers>=1",),
            )

    def save(self, run_dir: Path) -> None:
        """lexicon.txt: the training words, which the lexicon decoders need at inference; lm.arpa: beam_lm's
        n-gram."""
        if self.lexicon is not None:
            write_text_atomic(run_dir / LEXICON_FILE, "".join(f"{w}\n" for w in self.lexicon.words))
        if self.lm is not None:
            self.lm.save(run_dir / LM_FILE)

    def load(self, run_dir: Path) -> None:
        """The word list and (for beam_lm) the n-gram `save` wrote in `run_dir`, where there are any."""
        if (run_dir / LEXICON_FILE).is_file():
            self.use(Lexicon((run_dir / LEXICON_FILE).read_text().split()))
        if self.decoder == "beam_lm" and (run_dir / LM_FILE).is_file():
            self.use(lm=NGramLM.from_arpa(run_dir / LM_FILE))

    def language_model(self, texts: Iterable[str] | None = None) -> NGramLM:
        """task.lm's ARPA file, else an n-gram built from task.lm_text or the training transcripts (`texts`;
        None: read from the data)."""
        if self.lm_path:
            return NGramLM.from_arpa(self.lm_path)
        if self.lm_text:
            return kneser_ney(read_sentences(self.lm_text), self.lm_order)
        texts = self.source_texts() if texts is None else texts
        return kneser_ney([t.split() for t in texts], self.lm_order)

    def decode(self, log_probs: torch.Tensor, lengths: torch.Tensor, tokenizer: Any) -> list[str]:
        """Transcripts of (B, T, V) CTC log-probabilities."""
        if self.lexicon is None and self.decoder in ("lexicon", "beam_lexicon"):
            self.read_data()  # e.g. transcribing after training: the words come from the data
        if self.decoder.startswith("beam"):
            if self._beam is None:
                if self.decoder == "beam_lm" and self.lm is None:
                    self.lm = self.language_model()  # a run trained without beam_lm saved none
                self._beam = BeamSearchDecoder(
                    tokenizer,
                    self.beam_size,
                    self.lexicon.words if self.decoder == "beam_lexicon" else None,
                    self.word_score,
                    lm=self.lm if self.decoder == "beam_lm" else None,
                    lm_weight=self.lm_weight,
                )
            return self._beam(log_probs, lengths)
        greedy = [tokenizer.decode(ids) for ids in greedy_decode(log_probs, lengths, tokenizer.blank)]
        if self.decoder == "lexicon":
            return [self.lexicon.correct(h) for h in greedy]
        return greedy

    def hypotheses(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        log_probs: torch.Tensor | None,
        lengths: torch.Tensor | None,
        tokenizer: Any,
    ) -> list[str]:
        """Transcripts by the configured decoder; joint runs the encoder again for the decoder's memory; a
        sequence-to-sequence model decodes its own (greedy, with its KV cache)."""
        net = asr_model(model)
        if net.seq2seq:
            return [tokenizer.decode(i) for i in net.generate(batch["audio"], batch["audio_lengths"])]
        if self.decoder != "joint":
            return self.decode(log_probs, lengths, tokenizer)
        memory, frames = net.encode(batch["features"], batch["feature_lengths"])
        found = joint_beam_search(
            net.attention_decoder,
            memory,
            frames,
            log_probs,
            beam_size=self.beam_size,
            ctc_weight=self.ctc_weight,
            sos=SOS,
            eos=EOS,
            blank=tokenizer.blank,
        )
        return [tokenizer.decode(ids) for ids, _ in found]

    def transcripts(self, model: nn.Module, batch: dict[str, torch.Tensor], tokenizer: Any) -> list[str]:
        """Transcripts of a batch of the model's inputs (after the task's front end): the model's CTC output
        decoded by `hypotheses`, or a sequence-to-sequence model's own decoding."""
        log_probs, lengths = (None, None) if asr_model(model).seq2seq else model(*model_inputs(batch))
        return self.hypotheses(model, batch, log_probs, lengths, tokenizer)


class Scores:
    """Loss, WER and CER pooled over batches (all words/characters), raw and after Whisper's English
    normaliser (`audio.scoring`, each utterance's row kept), plain greedy WER/CER beside another decoder's
    (`greedy_too`) so its gain is visible, and a joint model's two loss terms."""

    def __init__(self, *, greedy_too: bool) -> None:
        """Nothing counted yet."""
        self.greedy_too = greedy_too
        self.utterances = UtteranceScores(english_normalizer())
        self.greedy_counts = {"word_errors": 0, "words": 0, "char_errors": 0, "chars": 0}
        self.loss_sum, self.n, self.part_sums = 0.0, 0, {}

    def add(
        self,
        batch: dict[str, torch.Tensor],
        hyps: list[str],
        log_probs: torch.Tensor | None,
        lengths: torch.Tensor | None,
        tokenizer: Any,
        loss: torch.Tensor,
        parts: dict[str, torch.Tensor],
    ) -> None:
        """Count one batch: its references against `hyps` (and CTC's greedy transcripts)."""
        refs = [
            tokenizer.decode(t[:m].tolist())
            for t, m in zip(batch["targets"].cpu(), batch["target_lengths"].tolist(), strict=True)
        ]
        self.utterances.add(refs, hyps)
        if self.greedy_too:
            greedy = greedy_decode(log_probs, lengths, tokenizer.blank)
            for k, v in edit_counts(refs, [tokenizer.decode(ids) for ids in greedy]).items():
                self.greedy_counts[k] += v
        self.loss_sum += float(loss) * len(refs)
        for k, v in parts.items():
            self.part_sums[k] = self.part_sums.get(k, 0.0) + float(v) * len(refs)
        self.n += len(refs)

    def result(self) -> dict[str, float]:
        """The means and rates of everything counted."""
        n = max(self.n, 1)
        out = {"loss": self.loss_sum / n} | {k: v / n for k, v in self.part_sums.items()}
        out |= self.utterances.rates()
        if self.greedy_too:
            out |= {f"greedy_{k}": v for k, v in error_rates(self.greedy_counts).items()}
        return out
