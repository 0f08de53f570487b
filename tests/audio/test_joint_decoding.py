"""audio.joint_decoding: CTC prefix scores against enumerating every alignment, and the joint beam search
against scoring every label sequence by hand."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from audio.joint_decoding import CTCPrefixScorer, joint_beam_search
from core.nn.decoder import TransformerDecoder

# float64 throughout; sums of <= 3^6 path probabilities
TOL = 1e-9


def collapse(path: tuple[int, ...], blank: int = 0) -> tuple[int, ...]:
    """CTC's many-to-one map: merge repeats, drop blanks."""
    out = []
    for i, s in enumerate(path):
        if s != blank and (i == 0 or s != path[i - 1]):
            out.append(s)
    return tuple(out)


def brute_prefix(log_probs: torch.Tensor, prefix: tuple[int, ...]) -> float:
    """log of the total probability of the alignments (T frames, V symbols) whose labels begin `prefix`."""
    t, v = log_probs.shape
    total = torch.tensor(0.0, dtype=torch.float64)
    for path in itertools.product(range(v), repeat=t):
        if collapse(path)[: len(prefix)] == prefix:
            total = total + log_probs[torch.arange(t), list(path)].sum().exp()
    return float(total.log())


@pytest.mark.parametrize("prefix", [(), (1,), (2,), (1, 1), (1, 2), (2, 2, 1)])
def test_prefix_scores_equal_the_sum_over_alignments(prefix: tuple[int, ...]) -> None:
    # 6 frames of 3 symbols (blank + 2 labels), two utterances, the second 4 frames long (2 padded)
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64).log_softmax(-1)
    lengths = torch.tensor([6, 4])
    scorer = CTCPrefixScorer(log_probs, lengths, blank=0)
    state = scorer.initial()
    cand = torch.tensor([[1, 2], [1, 2]])
    for i, label in enumerate(prefix):
        got, ext = scorer.extend(state, torch.tensor([prefix[i - 1] if i else 0] * 2), cand, labels=i)
        for n, frames in enumerate(lengths.tolist()):
            for c in range(2):
                want = brute_prefix(log_probs[n, :frames], prefix[:i] + (c + 1,))
                assert got[n, c].item() == pytest.approx(want, abs=TOL) or (
                    want == -float("inf") == got[n, c]
                )
        state = ext[:, :, torch.arange(2), torch.tensor([label - 1] * 2)]
    # the prefix as a whole sequence: CTC's own loss
    whole = scorer.complete(state)
    targets = torch.tensor([list(prefix)] * 2, dtype=torch.long).view(2, len(prefix))
    nll = F.ctc_loss(
        log_probs.transpose(0, 1), targets, lengths, torch.tensor([len(prefix)] * 2), reduction="none"
    )
    torch.testing.assert_close(whole, -nll, rtol=0, atol=TOL)


@torch.no_grad()
def joint_score(decoder, memory, log_probs, frames, labels, weight) -> float:
    """(1 - w) log p_att(labels, eos) + w log p_ctc(labels) of one utterance, computed from scratch."""
    seq = torch.tensor([[0, *labels]])
    att = decoder(seq, memory[None, :frames]).double().log_softmax(-1)[0]
    att_lp = att[torch.arange(len(labels) + 1), torch.tensor([*labels, 0])].sum()
    ctc_lp = -F.ctc_loss(
        log_probs[:frames, None],
        torch.tensor([labels], dtype=torch.long).view(1, len(labels)),
        torch.tensor([frames]),
        torch.tensor([len(labels)]),
        reduction="sum",
    )
    return float((1 - weight) * att_lp + weight * ctc_lp)


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_a_wide_beam_finds_the_best_joint_score_of_every_sequence(weight: float) -> None:
    # 3 symbols (id 0: blank, sos and eos), 3 frames: at most 3 labels, 15 sequences; a beam of 8 holds
    # every prefix, so the search is exhaustive and must return the best of them with its exact score
    torch.manual_seed(0)
    decoder = TransformerDecoder(3, 16, 2, 1).double().eval()
    memory = torch.randn(2, 3, 16, dtype=torch.float64)
    log_probs = torch.randn(2, 3, 3, dtype=torch.float64).log_softmax(-1)
    lengths = torch.tensor([3, 2])
    found = joint_beam_search(
        decoder, memory, lengths, log_probs, beam_size=8, ctc_weight=weight, sos=0, eos=0, blank=0, pre_beam=3
    )
    for n, frames in enumerate(lengths.tolist()):
        every = [list(s) for m in range(frames + 1) for s in itertools.product((1, 2), repeat=m)]
        scores = [joint_score(decoder, memory[n], log_probs[n], frames, s, weight) for s in every]
        ids, score = found[n]
        best = max(range(len(every)), key=scores.__getitem__)
        assert ids == every[best] and score == pytest.approx(scores[best], abs=1e-9)
