"""The embedded benchmarks' documents: questions about the KJV verses that no training set here sees, each a
seeded pick over lists in canonical order, so every machine and process builds the same rows."""

from __future__ import annotations

import functools
import inspect
import random
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from text.chat import QUESTION, chat
from text.corpus import Verse, in_validation, kjv_books, kjv_verses, split_tail
from text.datasets import kjv_groups
from text.lm_data import kjv

SEED = 0
#: options per multiple-choice question: the gold and three distractors
CHOICES = 4
#: distractor continuations are drawn from the verses whose continuation is nearest in length to the gold's
NEAREST = 12
#: a verse shorter than this (in words) gives too little context for its next words
MIN_WORDS = 6
#: the longest choice, in characters: lm-eval scores a choice whole and fails on one longer than the model's
#: context (it shortens only the context, from the left), so every choice fits the 128 positions of the lm
#: task's default byte-level model with its leading space
MAX_CHOICE_CHARS = 96
#: frequent words a cloze does not mask: filling them tests grammar, not knowledge of the verse
STOPWORDS = frozenset({
    "also", "been", "came", "come", "even", "from", "hast", "hath", "have", "into", "made", "make",
    "shall", "shalt", "should", "that", "their", "them", "then", "there", "these", "they", "thou", "thee",
    "thus", "unto", "upon", "were", "what", "when", "which", "will", "with", "would", "your",
})  # fmt: skip
WORD = re.compile(r"[A-Za-z]+")

Row = dict[str, Any]


def _default(builder: Callable[..., Any], key: str) -> float:
    """The default of `key` in a dataset builder's signature: the split its training run uses unless told."""
    return inspect.signature(builder).parameters[key].default


def held_out_fractions() -> dict[str, float]:
    """The default held-out shares of the KJV training sets: the LM corpus's book tails (`kjv`), and the
    hash split of the chat questions (`chat`) and book-group labels (`kjv_groups`)."""
    return {
        "lm_tail": _default(kjv, "val_fraction"),
        "hash": min(_default(chat, "val_fraction"), _default(kjv_groups, "val_fraction")),
    }


def lm_held_out(tail_fraction: float) -> set[int]:
    """Indices into `kjv_verses()` of the verses in the book tails the `kjv` LM corpus validates on."""
    out, start = set(), 0
    for doc in kjv_books():
        n = doc.count("\n")
        tail = split_tail(doc, tail_fraction)[1].count("\n")
        out.update(range(start + n - tail, start + n))
        start += n
    return out


@functools.lru_cache(maxsize=1)
def held_out_verses() -> tuple[Verse, ...]:
    """The verses held out by every KJV training set at its default split (`held_out_fractions`), less any
    whose text a training verse repeats word for word; in canonical order."""
    verses, fractions = kjv_verses(), held_out_fractions()
    tail = lm_held_out(fractions["lm_tail"])
    held = {i for i in tail if in_validation(verses[i].reference, fractions["hash"])}
    seen = {v.text for i, v in enumerate(verses) if i not in held}
    return tuple(verses[i] for i in sorted(held) if verses[i].text not in seen)


def _shuffled_choices(gold: str, distractors: list[str], rng: random.Random) -> tuple[list[str], int]:
    """The gold and its distractors in a seeded order, and the gold's index."""
    choices = [gold, *distractors]
    rng.shuffle(choices)
    return choices, choices.index(gold)


def _split_words(text: str) -> tuple[str, str]:
    """`text` as (context, continuation) at a space: the continuation is the second half of the words, or
    the fewer last words that fit MAX_CHOICE_CHARS."""
    words = text.split()
    cut = len(words) // 2
    while len(" ".join(words[cut:])) > MAX_CHOICE_CHARS:
        cut += 1
    return " ".join(words[:cut]), " ".join(words[cut:])


def _previous_lines(verses: tuple[Verse, ...]) -> list[str]:
    """For each of `verses`, the verse before it in its book and a line break, as the LM corpus reads it
    ("" for a book's first verse)."""
    everything = kjv_verses()
    index = {v.reference: i for i, v in enumerate(everything)}
    out = []
    for v in verses:
        before = everything[index[v.reference] - 1] if index[v.reference] > 0 else None
        out.append(before.text + "\n" if before is not None and before.book == v.book else "")
    return out


def next_words_docs(verses: tuple[Verse, ...], rng: random.Random) -> list[Row]:
    """Each verse's first words (`_split_words`) after the verse before it as context; its true continuation
    among three other verses' continuations of the nearest lengths.

    The verse before gives the model the running text it was trained on, and keeps this task's context and
    gold from being a split of the same string as kjv_cloze's: lm-eval's HFLM shares one forward pass among
    requests whose context and continuation tokens but the last agree, and scored the second split with the
    first's logits (the cloze gold at -256 against -47 when both tasks ran in one evaluation)."""
    long = [v for v in verses if len(v.text.split()) >= MIN_WORDS]
    halves = [_split_words(v.text) for v in long]
    rows = []
    for i, (v, before, (context, gold)) in enumerate(zip(long, _previous_lines(long), halves, strict=True)):
        others = sorted(
            {h for j, (_, h) in enumerate(halves) if j != i and h != gold},
            key=lambda h: (abs(len(h) - len(gold)), h),
        )
        choices, label = _shuffled_choices(gold, rng.sample(others[:NEAREST], CHOICES - 1), rng)
        rows.append(
            {"reference": v.reference, "context": before + context, "choices": choices, "label": label}
        )
    return rows


def book_docs(verses: tuple[Verse, ...], rng: random.Random) -> list[Row]:
    """Each verse asked as "Which book holds this verse?" (the chat questions' words), its book among three
    other books; the rows serve both the multiple-choice and the generation task."""
    books = list(dict.fromkeys(v.book for v in kjv_verses()))
    rows = []
    for v in verses:
        others = rng.sample([b for b in books if b != v.book], CHOICES - 1)
        choices, label = _shuffled_choices(v.book, others, rng)
        question = QUESTION + v.text
        rows.append(
            {
                "reference": v.reference,
                "question": question,
                "book": v.book,
                "choices": choices,
                "label": label,
            }
        )
    return rows


def _maskable(text: str) -> list[re.Match[str]]:
    """The words of `text` a cloze may mask: not the first, after a space, of 4+ letters, no stopword, with
    the rest of the verse after it (its choice) within MAX_CHOICE_CHARS."""
    return [
        m
        for m in WORD.finditer(text)
        if m.start() > 0
        and text[m.start() - 1] == " "
        and len(text) - m.start() <= MAX_CHOICE_CHARS  # the word and the rest of the verse: its choice
        and len(m.group()) >= 4
        and m.group().lower() not in STOPWORDS
    ]


def cloze_docs(verses: tuple[Verse, ...], rng: random.Random) -> list[Row]:
    """Each verse with one content word blanked, its four candidate fillings scored as the whole rest of the
    verse after the words before the blank: the true word and three content words of other held-out verses,
    capitalised alike (a capital would give a name away), each choice within MAX_CHOICE_CHARS."""
    pool = sorted({m.group() for v in verses for m in _maskable(v.text)})
    rows = []
    for v in verses:
        spots = _maskable(v.text)
        if not spots:
            continue
        spot = rng.choice(spots)
        word, rest = spot.group(), v.text[spot.end() :]
        alike = [
            w
            for w in pool
            if w[0].isupper() == word[0].isupper()
            and w.lower() != word.lower()
            and len(w + rest) <= MAX_CHOICE_CHARS
        ]
        words, label = _shuffled_choices(word, rng.sample(alike, CHOICES - 1), rng)
        rows.append(
            {
                "reference": v.reference,
                "prefix": v.text[: spot.start() - 1],
                "words": words,
                "choices": [w + rest for w in words],
                "label": label,
            }
        )
    return rows


#: each task's rows; the book rows serve two tasks
BUILDERS: dict[str, Callable[[tuple[Verse, ...], random.Random], list[Row]]] = {
    "kjv_next_words": next_words_docs,
    "kjv_book_mc": book_docs,
    "kjv_book_gen": book_docs,
    "kjv_cloze": cloze_docs,
}
TASKS = tuple(BUILDERS)


@functools.lru_cache(maxsize=1)
def task_docs() -> dict[str, list[Row]]:
    """Every task's rows, each from its own seeded generator (a task added later leaves the others' rows)."""
    verses = held_out_verses()
    return {task: build(verses, random.Random(f"{task}-{SEED}")) for task, build in BUILDERS.items()}


def majority_share(rows: list[Row], key: str) -> float:
    """The share of `rows` whose `key` is the most common value: what always giving that answer scores."""
    return Counter(r[key] for r in rows).most_common(1)[0][1] / len(rows)
