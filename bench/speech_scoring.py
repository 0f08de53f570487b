"""`python -m bench.speech_scoring [--utterances N] [--words N] [--repeats N]`: the milliseconds scoring one
utterance takes raw (`audio.scoring.score_utterance` without a normaliser) and with Whisper's English
normaliser beside it, side by side with the ratio: what wer_normalized/cer_normalized add to a validation
(docs/evaluation.md § Speech: raw and normalised WER). Hypotheses are references with every fifth word
changed; references are plain lower-case words, as the ASR task's transcripts are."""

from __future__ import annotations

import argparse
import random
import time

import torch

from audio.scoring import english_normalizer, score_utterance

WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "that",
    "he",
    "shall",
    "unto",
    "for",
    "his",
    "a",
    "lord",
    "they",
    "be",
    "is",
    "him",
    "not",
    "them",
    "it",
    "with",
    "all",
    "thou",
)


def pairs(n: int, words: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (reference, hypothesis) pairs of `words` words, every fifth hypothesis word another."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ref = [rng.choice(WORDS) for _ in range(words)]
        hyp = [w if i % 5 else rng.choice(WORDS) for i, w in enumerate(ref)]
        out.append((" ".join(ref), " ".join(hyp)))
    return out


def ms_per_utterance(items: list[tuple[str, str]], normalize: object, repeats: int) -> float:
    """The median over `repeats` rounds of the milliseconds scoring one of `items` takes."""
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for ref, hyp in items:
            score_utterance(ref, hyp, normalize)  # type: ignore[arg-type]
        rounds.append((time.perf_counter() - t) * 1000 / len(items))
    return sorted(rounds)[len(rounds) // 2]


def main() -> None:
    """Print one row per side and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--utterances", type=int, default=300)
    parser.add_argument("--words", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    normalize = english_normalizer()
    if normalize is None:
        raise SystemExit("bench.speech_scoring needs whisper-normalizer: pip install 'torchkiln[speech]'")
    items = pairs(args.utterances, args.words)
    normalize(items[0][0])  # its regular expressions compile on first use
    raw = ms_per_utterance(items, None, args.repeats)
    both = ms_per_utterance(items, normalize, args.repeats)
    print(f"{args.utterances} utterances of {args.words} words; {torch.get_num_threads()} torch threads")
    print("| scoring | ms per utterance |")
    print("|---|---|")
    print(f"| raw | {raw:.2f} |")
    print(f"| raw + normalised | {both:.2f} |")
    print(f"normalised / raw: {both / raw:.2f}x")


if __name__ == "__main__":
    main()
