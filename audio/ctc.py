"""Characters in and out of CTC: the tokenizer, greedy and beam-search decoding, and WER/CER."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torchaudio.functional as AF

from core.errors import ConfigError

_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def normalize_transcript(text: str) -> str:
    """Lower-case `text`, spell out digits one by one, keep only letters, apostrophes and single spaces."""
    text = text.lower()
    text = re.sub(r"\d", lambda m: f" {_DIGIT_WORDS[int(m.group())]} ", text)
    text = re.sub(r"[^a-z' ]+", " ", text)
    return " ".join(text.split())


class CharTokenizer:
    """Characters <-> ids for CTC: id 0 is the blank, then space, apostrophe and a-z."""

    blank = 0

    def __init__(self) -> None:
        """Build the fixed alphabet."""
        self.symbols = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
        self._ids = {s: i for i, s in enumerate(self.symbols)}

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Ids of a normalised transcript."""
        return [self._ids[c] for c in normalize_transcript(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of label ids (blanks dropped, no CTC collapsing)."""
        return "".join(self.symbols[i] for i in ids if i != self.blank)


def frames_needed(ids: Sequence[int]) -> int:
    """The fewest output frames CTC can align the label sequence `ids` to: one per label, plus a blank
    between each pair of equal neighbours (without it the two would merge into one)."""
    return len(ids) + sum(a == b for a, b in zip(ids[:-1], ids[1:], strict=True))


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0) -> list[list[int]]:
    """Best path per utterance of (B, T, V) scores: argmax, merge repeats, drop blanks."""
    best = log_probs.argmax(-1).cpu()
    out = []
    for b, n in enumerate(lengths.tolist()):
        path = best[b, :n]
        keep = torch.ones_like(path, dtype=torch.bool)
        keep[1:] = path[1:] != path[:-1]
        out.append([i for i in path[keep].tolist() if i != blank])
    return out


def beam_search_available() -> bool:
    """Whether torchaudio's CTC beam-search decoder can load (it needs the flashlight-text package)."""
    return importlib.util.find_spec("flashlight") is not None


def require_beam_search() -> None:
    """Raise a one-line ConfigError naming the fix when the beam-search decoder cannot load."""
    if not beam_search_available():
        raise ConfigError(
            "task.decoder=beam/beam_lexicon needs flashlight-text: pip install 'torchkiln[speech]' "
            "(or flashlight-text), or set task.decoder=greedy"
        )


class BeamSearchDecoder:
    """torchaudio's CTC beam search (flashlight-text, no language model), free or constrained to a lexicon.

    With `words`, every hypothesis is a sequence of those words: the search follows their spellings through a
    prefix tree, so a word boundary can only close a known word. On a closed vocabulary (the embedded
    corpus) this fixes the word splits and merges that per-word snapping cannot.
    """

    def __init__(
        self,
        tokenizer: CharTokenizer,
        beam_size: int = 8,
        words: Iterable[str] | None = None,
        word_score: float = 0.0,
    ) -> None:
        """`word_score` is added per emitted word (> 0 favours more, shorter words)."""
        require_beam_search()
        import tempfile

        from torchaudio.models.decoder import ctc_decoder

        # torchaudio's decoder spells the blank '-' and the word boundary '|'
        self.tokens = ["-", "|"] + tokenizer.symbols[2:]
        self._boundary = self.tokens.index("|")
        lexicon = None
        with tempfile.TemporaryDirectory() as tmp:  # the decoder reads the lexicon file once, when built
            if words is not None:
                spellable = sorted({w for w in words if w and all(c in tokenizer.symbols[2:] for c in w)})
                if not spellable:
                    raise ConfigError(
                        "the beam-search lexicon is empty: the training transcripts have no words"
                    )
                lexicon = Path(tmp) / "lexicon.txt"
                lexicon.write_text("".join(f"{w}\t{' '.join(w)} |\n" for w in spellable))
            self._decoder = ctc_decoder(
                lexicon=None if lexicon is None else str(lexicon),
                tokens=self.tokens,
                beam_size=beam_size,
                blank_token="-",
                sil_token="|",
                word_score=word_score,
                lm_weight=0.0,
            )
        self.constrained = lexicon is not None

    def __call__(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best transcript per utterance of (B, T, V) log-probabilities."""
        log_probs, lengths = log_probs.detach().float().cpu(), lengths.cpu().long()
        if self.constrained:
            # Spellings end at a word boundary (as transcripts separate words by spaces), so the last word
            # needs one after it too: append a frame that is certainly one.
            b, t, v = log_probs.shape
            end = torch.full((b, t + 1, v), -1e4)
            end[:, :t] = log_probs
            end[torch.arange(b), lengths] = torch.where(torch.arange(v) == self._boundary, 0.0, -1e4)
            log_probs, lengths = end, lengths + 1
        hyps = self._decoder(log_probs.contiguous(), lengths.to(torch.int32))
        if self.constrained:
            return [" ".join(h[0].words) if h else "" for h in hyps]
        out = []
        for h in hyps:
            chars = "".join(self.tokens[i] for i in h[0].tokens.tolist()) if h else ""
            out.append(" ".join(chars.replace("-", "").replace("|", " ").split()))
        return out


def edit_counts(refs: Sequence[str], hyps: Sequence[str]) -> dict[str, int]:
    """Word and character edit distances and reference lengths, summed over pairs."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    out = {"word_errors": 0, "words": 0, "char_errors": 0, "chars": 0}
    for ref, hyp in zip(refs, hyps, strict=True):
        out["word_errors"] += AF.edit_distance(ref.split(), hyp.split())
        out["words"] += len(ref.split())
        out["char_errors"] += AF.edit_distance(list(ref), list(hyp))
        out["chars"] += len(ref)
    return out


def error_rates(counts: dict[str, int]) -> dict[str, float]:
    """WER and CER of `edit_counts`' sums: word edits over reference words, character edits over reference
    characters (spaces included), each pooled over every pair."""
    return {
        "wer": counts["word_errors"] / max(counts["words"], 1),
        "cer": counts["char_errors"] / max(counts["chars"], 1),
    }


def wer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Word error rate: total word edits over total reference words."""
    return error_rates(edit_counts(refs, hyps))["wer"]


def cer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Character error rate: total character edits over total reference characters (spaces included)."""
    return error_rates(edit_counts(refs, hyps))["cer"]


class Lexicon:
    """Closed-vocabulary correction: each hypothesis word outside the lexicon becomes its nearest word in it.

    Needs no extra package; it fixes misspellings such as "kaichen" -> "kitchen", not real-word confusions
    ("to" for "two") nor merged or split words, which the lexicon-constrained `BeamSearchDecoder` does fix.
    """

    def __init__(self, words: Iterable[str]) -> None:
        """Words a transcript may contain."""
        self.words = sorted(set(words))
        self._known = set(self.words)
        self._cache: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.words)

    def nearest(self, word: str) -> str:
        """`word` itself if known, else the lexicon word with the fewest character edits (first on ties)."""
        if word in self._known:
            return word
        if word not in self._cache:
            self._cache[word] = min(self.words, key=lambda w: AF.edit_distance(list(word), list(w)))
        return self._cache[word]

    def correct(self, text: str) -> str:
        """`text` with every word snapped to the lexicon."""
        return " ".join(self.nearest(w) for w in text.split())
