"""Word n-gram language models for CTC decoding: built from a text corpus with interpolated Kneser-Ney
smoothing, written and read as ARPA files (the format KenLM's `lmplz` writes and SRILM reads).

Smoothing (Chen & Goodman 1998, interpolated Kneser-Ney with one discount per order, as KenLM counts):

    p_k(w | h) = max(a(h w) - D_k, 0) / sum_v a(h v)  +  gamma(h) p_{k-1}(w | h[1:])
    gamma(h)   = D_k |{v : a(h v) > 0}| / sum_v a(h v)
    p_0(w)     = 1 / |V|      (V: the corpus's words, </s> and <unk>; never <s>)

where a() is the raw count at the highest order and for n-grams starting with <s>, otherwise the
continuation count (distinct words seen before it). D_k = n1 / (n1 + 2 n2) over order k's counts of one and
two (Ney's estimate; 0.5 where a count of either is zero) unless given. In ARPA form a seen n-gram stores
log10 p_k, and its context stores log10 gamma as the backoff weight, so an unseen n-gram's backed-off
probability is exactly the interpolated one. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from audio.transcripts import normalize_transcript
from core.errors import DataError

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
#: what ARPA files write for log10(0): <s> is never predicted
LOG10_ZERO = -99.0


class NGramLM:
    """A backoff n-gram model: per n-gram its log10 probability and (below the top order) log10 backoff."""

    def __init__(self, grams: Sequence[dict[tuple[str, ...], tuple[float, float]]]) -> None:
        """`grams[k-1]` maps each k-gram to (log10 probability, log10 backoff weight)."""
        if not grams or not grams[0]:
            raise DataError("an n-gram model needs unigrams")
        self.grams = [dict(g) for g in grams]
        self.order = len(self.grams)
        self.vocab = {g[0] for g in self.grams[0]}

    def log10_prob(self, word: str, context: Sequence[str] = ()) -> float:
        """log10 p(word | context) by backoff; a word outside the vocabulary is scored as <unk>."""
        word = word if word in self.vocab else UNK
        context = (
            tuple(c if c in self.vocab else UNK for c in context)[-(self.order - 1) :]
            if self.order > 1
            else ()
        )
        backoff = 0.0
        while True:
            hit = self.grams[len(context)].get(context + (word,))
            if hit is not None:
                return backoff + hit[0]
            if not context:
                return backoff + LOG10_ZERO  # a vocabulary without <unk>
            ctx = self.grams[len(context) - 1].get(context)
            backoff += 0.0 if ctx is None else ctx[1]
            context = context[1:]

    def state(self, context: Sequence[str]) -> tuple[str, ...]:
        """The part of `context` the model can condition on: its last order-1 words, shortened while the
        model holds no such n-gram (so equal futures share one decoder state)."""
        ctx = (
            tuple(c if c in self.vocab else UNK for c in context)[-(self.order - 1) :]
            if self.order > 1
            else ()
        )
        while ctx and ctx not in self.grams[len(ctx) - 1]:
            ctx = ctx[1:]
        return ctx

    def sentence_log10_prob(self, words: Sequence[str]) -> float:
        """log10 p(words </s> | <s>)."""
        history, total = [BOS], 0.0
        for w in [*words, EOS]:
            total += self.log10_prob(w, history)
            history.append(w)
        return total

    @property
    def words(self) -> list[str]:
        """The vocabulary without <s>, </s> and <unk>, sorted."""
        return sorted(self.vocab - {BOS, EOS, UNK})

    def to_arpa(self) -> str:
        """The model as ARPA text."""
        lines = ["", "\\data\\"] + [f"ngram {k + 1}={len(g)}" for k, g in enumerate(self.grams)]
        for k, g in enumerate(self.grams):
            lines += ["", f"\\{k + 1}-grams:"]
            for gram, (logp, bow) in sorted(g.items()):
                row = f"{logp:.7g}\t{' '.join(gram)}"
                lines.append(row + (f"\t{bow:.7g}" if k + 1 < self.order and bow != 0.0 else ""))
        return "\n".join([*lines, "", "\\end\\", ""])

    def save(self, path: Path) -> None:
        """Write the ARPA file (atomically)."""
        from core.files import write_text_atomic

        write_text_atomic(path, self.to_arpa())

    @classmethod
    def from_arpa(cls, path: str | Path) -> NGramLM:
        """Read an ARPA file (e.g. from KenLM's lmplz); a malformed one is a one-line DataError."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise _not_arpa(
                path, f"cannot read the ARPA language model {path} ({type(e).__name__})"
            ) from None
        grams: list[dict[tuple[str, ...], tuple[float, float]]] = []
        order = 0
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("ngram ") or line in ("\\data\\", "\\end\\"):
                continue
            if line.startswith("\\") and line.endswith("-grams:"):
                order = int(line[1:].split("-")[0])
                grams += [{} for _ in range(order - len(grams))]
                continue
            parts = line.split()
            try:
                if order == 0 or len(parts) not in (order + 1, order + 2):
                    raise ValueError(f"expected {order} words after the probability")
                bow = float(parts[order + 1]) if len(parts) == order + 2 else 0.0
                grams[order - 1][tuple(parts[1 : order + 1])] = (float(parts[0]), bow)
            except ValueError as e:
                raise _not_arpa(path, f"{path}:{n} is not an ARPA n-gram line ({e})") from None
        if not grams:
            raise _not_arpa(path, f"{path} holds no \\1-grams: section; give an ARPA file")
        return cls(grams)


def _not_arpa(path: Path, message: str) -> DataError:
    """The DataError for a task.lm file that cannot be read as ARPA: its path, and what it should be."""
    return DataError(message, key="task.lm", value=str(path), valid=("an ARPA file",))


def ney_discount(counts: Iterable[int]) -> float:
    """n1 / (n1 + 2 n2) of the counts of one and two; 0.5 where either is zero (too little data)."""
    tally = Counter(counts)
    n1, n2 = tally[1], tally[2]
    return n1 / (n1 + 2 * n2) if n1 and n2 else 0.5


def kneser_ney(
    sentences: Iterable[Sequence[str]], order: int = 3, discounts: Sequence[float] | None = None
) -> NGramLM:
    """An interpolated Kneser-Ney model of `order` over `sentences` (lists of words); `discounts[k-1]` is
    D_k (default: Ney's estimate per order)."""
    if order < 1:
        raise ValueError(f"order={order} must be >= 1")
    raw: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]
    for words in sentences:
        padded = [BOS, *words, EOS]
        for k in range(1, order + 1):
            for i in range(len(padded) - k + 1):
                raw[k - 1][tuple(padded[i : i + k])] += 1
    if len(raw[0]) <= 2:
        raise DataError("the language-model corpus holds no words; give it sentences")
    # adjusted counts: raw at the top order and after <s>, else the distinct words seen before
    adj: list[dict[tuple[str, ...], int]] = [dict(raw[-1])]
    for k in range(order - 1, 0, -1):
        left: Counter[tuple[str, ...]] = Counter(g[1:] for g in raw[k])
        adj.insert(0, {g: c if g[0] == BOS else left[g] for g, c in raw[k - 1].items()})
    adj[0].pop((BOS,), None)  # never predicted: kept only as a context
    if discounts is None:
        discounts = [ney_discount(a.values()) for a in adj]
    if len(discounts) != order:
        raise ValueError(f"{len(discounts)} discounts for order {order}")
    vocab = {g[0] for g in adj[0]} | {UNK}
    # per order k and context h: sum of adjusted counts and number of distinct followers
    totals: list[dict[tuple[str, ...], list[int]]] = []
    for a in adj:
        t: dict[tuple[str, ...], list[int]] = defaultdict(lambda: [0, 0])
        for g, c in a.items():
            t[g[:-1]][0] += c
            t[g[:-1]][1] += 1
        totals.append(t)

    def gamma(k: int, h: tuple[str, ...]) -> float:
        total, types = totals[k - 1][h]
        return discounts[k - 1] * types / total

    def prob(k: int, h: tuple[str, ...], w: str) -> float:
        lower = 1 / len(vocab) if k == 1 else prob(k - 1, h[1:], w)
        if h not in totals[k - 1]:
            return lower
        c = adj[k - 1].get(h + (w,), 0)
        return max(c - discounts[k - 1], 0) / totals[k - 1][h][0] + gamma(k, h) * lower

    grams: list[dict[tuple[str, ...], tuple[float, float]]] = []
    for k in range(1, order + 1):
        entries = list(adj[k - 1]) + ([(w,) for w in (UNK, BOS)] if k == 1 else [])
        level: dict[tuple[str, ...], tuple[float, float]] = {}
        for g in entries:
            logp = LOG10_ZERO if g == (BOS,) else math.log10(prob(k, g[:-1], g[-1]))
            bow = math.log10(gamma(k + 1, g)) if k < order and g in totals[k] else 0.0
            level[g] = (logp, bow)
        grams.append(level)
    return NGramLM(grams)


def read_sentences(path: str | Path) -> list[list[str]]:
    """The sentences of a text file, one a line, normalised as transcripts are; a missing or empty file is a
    one-line DataError naming the key task.lm_text."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"task.lm_text={path} cannot be read ({type(e).__name__}); give a UTF-8 text file, a "
            "sentence a line",
            key="task.lm_text",
            value=str(path),
            valid=("a UTF-8 text file",),
        ) from None
    sentences = [s.split() for s in map(normalize_transcript, lines) if s]
    if not sentences:
        raise DataError(
            f"task.lm_text={path} holds no words",
            key="task.lm_text",
            value=str(path),
            valid=("a UTF-8 text file",),
        )
    return sentences
