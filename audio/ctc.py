"""Text in and out of CTC: the character and subword tokenizers, greedy and beam-search decoding (with an
n-gram LM if given), and WER/CER."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torchaudio.functional as AF

from audio.ngram import BOS, EOS, NGramLM
from audio.transcripts import normalize_transcript
from core.errors import ConfigError, unknown_choice


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

    # torchaudio's beam search spells the blank '-' and the word boundary '|'
    def beam_tokens(self) -> tuple[list[str], str, str]:
        """(the beam search's token names by id, the blank's, the word boundary's)."""
        return ["-", "|"] + self.symbols[2:], "-", "|"

    def spell(self, word: str) -> list[str] | None:
        """`word`'s spelling in beam tokens, ending at a word boundary (None if a character is not a letter
        or apostrophe)."""
        if not word or not all(self._ids.get(c, 0) > 1 for c in word):
            return None
        return [*word, "|"]


#: task.tokenizer values: characters, or a subword vocabulary learned from the training transcripts
TOKENIZERS = ("chars", "bpe", "unigram")
#: the word-start marker of subword pieces (the `tokenizers` Metaspace convention, as in SentencePiece)
WORD_START = "\u2581"


class SubwordTokenizer:
    """Subword pieces <-> ids for CTC (the `tokenizers` library's BPE or unigram model over words marked with
    a word-start piece, as SentencePiece does): id 0 is the blank, then <unk> and the learned pieces.

    Saved and loaded as the library's JSON (`to_json` / `from_json`): a vocabulary and merge rules, nothing
    that runs code."""

    blank = 0

    def __init__(self, backend: object) -> None:
        """Wrap a trained `tokenizers.Tokenizer` whose id 0 is <blank>."""
        self.backend = backend
        self.symbols = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
        if self.symbols[:1] != ["<blank>"] or WORD_START not in self.symbols:
            raise ConfigError(
                "a CTC subword tokenizer needs <blank> as id 0 and the word-start piece; retrain it"
            )

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Piece ids of a transcript (normalised first)."""
        return self.backend.encode(normalize_transcript(text)).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Words of piece ids (blanks and <unk> dropped, no CTC collapsing)."""
        return " ".join(self.backend.decode([i for i in ids if i != self.blank]).split())

    def beam_tokens(self) -> tuple[list[str], str, str]:
        """(the beam search's token names by id, the blank's, the word boundary's: the lone word-start
        piece, which every vocabulary `train` makes holds)."""
        return list(self.symbols), "<blank>", WORD_START

    def spell(self, word: str) -> list[str] | None:
        """`word`'s pieces as the tokenizer splits it (None if a piece would be <unk>)."""
        pieces = self.backend.encode(word).tokens if word else ["<unk>"]
        return None if "<unk>" in pieces else pieces

    def to_json(self) -> str:
        """The tokenizer as the `tokenizers` library's JSON."""
        return self.backend.to_str()

    @classmethod
    def from_json(cls, text: str) -> SubwordTokenizer:
        """A tokenizer saved by `to_json`."""
        import tokenizers

        return cls(tokenizers.Tokenizer.from_str(text))

    @classmethod
    def train(cls, transcripts: Iterable[str], kind: str, vocab_size: int) -> SubwordTokenizer:
        """A `kind` (bpe or unigram) vocabulary of at most `vocab_size` ids (blank and <unk> included) learned
        from `transcripts`; every letter, the apostrophe and the word-start piece are always in it, so any
        transcript encodes without <unk>."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers, trainers

        alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["'", WORD_START]
        if vocab_size < len(alphabet) + 2:
            raise ConfigError(
                f"task.vocab_size={vocab_size} is too small for tokenizer={kind}: the alphabet alone needs "
                f"{len(alphabet) + 2} ids (blank and <unk> included)",
                key="task.vocab_size",
                value=str(vocab_size),
                valid=(f">= {len(alphabet) + 2}",),
            )
        specials = ["<blank>", "<unk>"]
        if kind == "bpe":
            tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
            trainer = trainers.BpeTrainer(
                vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
            )
        elif kind == "unigram":
            tok = tokenizers.Tokenizer(models.Unigram())
            trainer = trainers.UnigramTrainer(
                vocab_size=vocab_size,
                special_tokens=specials,
                unk_token="<unk>",
                initial_alphabet=alphabet,
                show_progress=False,
            )
        else:
            raise unknown_choice("task.tokenizer", kind, TOKENIZERS)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        texts = [t for t in map(normalize_transcript, transcripts) if t]
        # every letter as a word of its own: a unigram model otherwise drops the letters the transcripts lack
        tok.train_from_iterator([*texts, " ".join(alphabet[:-1])], trainer=trainer)
        return cls(tok)


def make_tokenizer(
    kind: str, vocab_size: int, transcripts: Iterable[str]
) -> CharTokenizer | SubwordTokenizer:
    """The task's tokenizer: characters, or subwords learned from `transcripts`."""
    if kind == "chars":
        return CharTokenizer()
    return SubwordTokenizer.train(transcripts, kind, vocab_size)


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
            "(or flashlight-text), or set task.decoder=greedy",
            key="task.decoder",
            value="beam/beam_lexicon",
            valid=("flashlight-text installed", "greedy"),
        )


#: natural log of 10: the decoder adds natural-log emission and LM scores, ARPA files hold log10
_LN10 = 2.302585092994046


def require_lm_decoding() -> None:
    """Raise a one-line ConfigError naming the fix when the LM beam search (torchaudio's flashlight-text
    decoder, with the n-gram model scored in Python) cannot load."""
    if not beam_search_available():
        raise ConfigError(
            "task.decoder=beam_lm needs flashlight-text: pip install 'torchkiln[speech]' "
            "(or flashlight-text), or set task.decoder=greedy",
            key="task.decoder",
            value="beam_lm",
            valid=("flashlight-text installed",),
        )


def _decoder_lm(lm: NGramLM, words: Sequence[str]) -> object:
    """`lm` as a torchaudio CTCDecoderLM over the decoder's word ids (`words[i]` is word id i): one decoder
    state per distinct n-gram context, natural-log scores."""
    from torchaudio.models.decoder import CTCDecoderLM, CTCDecoderLMState

    class NGramDecoderLM(CTCDecoderLM):
        def __init__(self) -> None:
            CTCDecoderLM.__init__(self)
            # the decoder merges hypotheses whose LM states are one object: equal contexts share it
            self.states: dict[tuple[str, ...], CTCDecoderLMState] = {}
            self.context: dict[CTCDecoderLMState, tuple[str, ...]] = {}
            self.scores: dict[tuple[tuple[str, ...], int], tuple[CTCDecoderLMState, float]] = {}

        def _state(self, parent: CTCDecoderLMState | None, index: int, ctx: tuple[str, ...]) -> object:
            state = self.states.get(ctx)
            if state is None:
                state = CTCDecoderLMState() if parent is None else parent.child(index)
                self.states[ctx], self.context[state] = state, ctx
            return state

        def start(self, start_with_nothing: bool) -> object:
            return self._state(None, -1, lm.state([BOS]))

        def score(self, state: object, index: int) -> tuple[object, float]:
            ctx = self.context[state]
            hit = self.scores.get((ctx, index))
            if hit is None:
                word = words[index]
                logp = lm.log10_prob(word, ctx) * _LN10
                hit = self.scores[(ctx, index)] = (self._state(state, index, lm.state((*ctx, word))), logp)
            return hit

        def finish(self, state: object) -> tuple[object, float]:
            return state, lm.log10_prob(EOS, self.context[state]) * _LN10

    return NGramDecoderLM()


class BeamSearchDecoder:
    """torchaudio's CTC beam search (flashlight-text): free, constrained to a lexicon, or over a lexicon
    with a word n-gram LM.

    With `words`, every hypothesis is a sequence of those words: the search follows their spellings (in the
    tokenizer's characters or subword pieces) through a prefix tree, so a word boundary can only close a
    known word. On a closed vocabulary (the embedded corpus) this fixes the word splits and merges that
    per-word snapping cannot. With `lm` (and no `words`: the LM's vocabulary), each word closed adds
    `lm_weight` x its natural-log LM probability given the words before it, as KenLM decoding does.
    """

    def __init__(
        self,
        tokenizer: CharTokenizer | SubwordTokenizer,
        beam_size: int = 8,
        words: Iterable[str] | None = None,
        word_score: float = 0.0,
        lm: NGramLM | None = None,
        lm_weight: float = 0.0,
    ) -> None:
        """`word_score` is added per emitted word (> 0 favours more, shorter words)."""
        require_beam_search()
        import tempfile

        from torchaudio.models.decoder import ctc_decoder

        self.tokenizer = tokenizer
        self.tokens, blank, boundary = tokenizer.beam_tokens()
        self._boundary = self.tokens.index(boundary)
        # a character spelling ends at a word boundary, so the last word needs one after it too
        self._end_boundary = isinstance(tokenizer, CharTokenizer)
        if lm is not None and words is None:
            words = lm.words
        lexicon = lm_dict = None
        with tempfile.TemporaryDirectory() as tmp:  # the decoder reads its files once, when built
            if words is not None:
                spelled = {w: tokenizer.spell(w) for w in sorted(set(words))}
                spelled = {w: s for w, s in spelled.items() if s}
                if not spelled:
                    raise ConfigError(
                        "the beam-search lexicon is empty: the word list has no spellable words"
                    )
                lexicon = Path(tmp) / "lexicon.txt"
                lexicon.write_text("".join(f"{w}\t{' '.join(s)}\n" for w, s in spelled.items()))
                if lm is not None:
                    # word id i is line i: the LM adapter reads words by the decoder's ids
                    vocab = ["<unk>", BOS, EOS, *spelled]
                    lm_dict = Path(tmp) / "words.txt"
                    lm_dict.write_text("".join(f"{w}\n" for w in vocab))
            self._decoder = ctc_decoder(
                lexicon=None if lexicon is None else str(lexicon),
                tokens=self.tokens,
                lm=None if lm is None else _decoder_lm(lm, vocab),
                lm_dict=None if lm_dict is None else str(lm_dict),
                beam_size=beam_size,
                blank_token=blank,
                sil_token=boundary,
                word_score=word_score,
                lm_weight=lm_weight if lm is not None else 0.0,
            )
        self.constrained = lexicon is not None

    def __call__(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best transcript per utterance of (B, T, V) log-probabilities."""
        log_probs, lengths = log_probs.detach().float().cpu(), lengths.cpu().long()
        if self.constrained and self._end_boundary:
            # append a frame that is certainly a word boundary, closing the last word's spelling
            b, t, v = log_probs.shape
            end = torch.full((b, t + 1, v), -1e4)
            end[:, :t] = log_probs
            end[torch.arange(b), lengths] = torch.where(torch.arange(v) == self._boundary, 0.0, -1e4)
            log_probs, lengths = end, lengths + 1
        hyps = self._decoder(log_probs.contiguous(), lengths.to(torch.int32))
        if self.constrained:
            return [" ".join(h[0].words) if h else "" for h in hyps]
        # the hypothesis's tokens come collapsed and without blanks; the tokenizer turns them into words
        return [" ".join(self.tokenizer.decode(h[0].tokens.tolist()).split()) if h else "" for h in hyps]


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
