"""Transcripts scored as speech benchmarks report them: each utterance's word and character errors, raw and
after Whisper's English text normaliser (numbers as digits, American spellings, no punctuation or fillers),
pooled into WER and CER over every word and character (`wer`/`cer` and `wer_normalized`/`cer_normalized`).

The normaliser is the `whisper-normalizer` package's (OpenAI's code, in the `speech` extra); without it the
normalised rates are left out, with one warning. The task has no language setting and its references are
English letters (`audio.transcripts`), so the English normaliser is the one used."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from audio.ctc import edit_counts, error_rates
from core.files import write_text_atomic

log = logging.getLogger(__name__)

#: what a normalised rate, text or count is called: its raw name and this suffix
NORMALIZED = "_normalized"
#: an utterance's raw counts (`audio.ctc.edit_counts`); each also comes with the suffix, after normalising
COUNTS = ("word_errors", "words", "char_errors", "chars")


@functools.cache
def english_normalizer() -> Callable[[str], str] | None:
    """Whisper's EnglishTextNormalizer, or None (warned once) when whisper-normalizer is not installed."""
    try:
        from whisper_normalizer.english import EnglishTextNormalizer
    except ImportError:
        log.warning(
            "wer_normalized/cer_normalized skipped: Whisper's text normaliser needs the whisper-normalizer "
            "package: pip install 'torchkiln[speech]'"
        )
        return None
    return EnglishTextNormalizer()


def score_utterance(ref: str, hyp: str, normalize: Callable[[str], str] | None) -> dict[str, Any]:
    """One utterance's reference, hypothesis and error counts, and (with `normalize`) the same after it."""
    row: dict[str, Any] = {"reference": ref, "hypothesis": hyp, **edit_counts([ref], [hyp])}
    if normalize is None:
        return row
    nref, nhyp = normalize(ref), normalize(hyp)
    row |= {"reference" + NORMALIZED: nref, "hypothesis" + NORMALIZED: nhyp}
    # most references are already plain lower-case words: their counts are known, skip the edit distances
    counts = row if (nref, nhyp) == (ref, hyp) else edit_counts([nref], [nhyp])
    return row | {k + NORMALIZED: counts[k] for k in COUNTS}


class UtteranceScores:
    """Scored utterances in the order added (`score_utterance` rows) and their pooled error rates."""

    def __init__(self, normalize: Callable[[str], str] | None) -> None:
        """Nothing scored yet; `normalize` (e.g. `english_normalizer()`) adds the normalised columns."""
        self.normalize = normalize
        self.rows: list[dict[str, Any]] = []

    def add(self, refs: Sequence[str], hyps: Sequence[str]) -> None:
        """Score each reference against its hypothesis (a ValueError when their counts differ)."""
        self.rows += [score_utterance(r, h, self.normalize) for r, h in zip(refs, hyps, strict=True)]

    def totals(self) -> dict[str, int]:
        """Each count summed over the utterances (the normalised ones too, when normalising)."""
        keys = COUNTS if self.normalize is None else (*COUNTS, *(k + NORMALIZED for k in COUNTS))
        return {k: sum(r[k] for r in self.rows) for k in keys}

    def rates(self) -> dict[str, float]:
        """wer and cer: total edits over total reference words/characters (not a mean of per-utterance
        rates), and wer_normalized and cer_normalized after the normaliser, when there is one."""
        totals = self.totals()
        out = error_rates(totals)
        if self.normalize is not None:
            normalized = error_rates({k: totals[k + NORMALIZED] for k in COUNTS})
            out |= {k + NORMALIZED: v for k, v in normalized.items()}
        return out

    def write(self, path: Path, order: Sequence[int], describe: Callable[[int], str]) -> dict[str, int]:
        """The rows as JSON lines in `path` (atomically), each after its dataset index (`order`: the
        indices in the order scored) and `describe(index)`, its audio file; the summed counts."""
        rows = zip(order, self.rows, strict=True)
        lines = (json.dumps({"index": i, "path": describe(i), **r}) + "\n" for i, r in rows)
        write_text_atomic(path, "".join(lines))
        return self.totals()
