"""Joint CTC/attention decoding (Watanabe et al., 2017; the hybrid decoders of ESPnet and NeMo): one beam
search over an attention decoder's next-token scores in which every extension of a hypothesis is also scored
by the CTC prefix probability of the extended label sequence, so CTC's monotonic alignment vetoes the
attention decoder's typical faults (dropped or looping words, stopping early or never).

score(y) = (1 - ctc_weight) * log p_att(y, eos | x) + ctc_weight * log p_ctc(y | x)
"""

from __future__ import annotations

import torch

from core.nn.decoder import TransformerDecoder

#: log-probabilities are floored here, so cumulative sums stay finite (e^-1e4 is 0 in float64 anyway)
FLOOR = -1e4


class CTCPrefixScorer:
    """CTC prefix log-probabilities log P(y... | x): of every hypothesis's extensions by candidate labels at
    once, and of hypotheses as complete label sequences (the forward recursion of Watanabe et al., 2017, in
    float64, vectorized over hypotheses and candidates, one step per frame from the first frame the
    extension can end at)."""

    def __init__(self, log_probs: torch.Tensor, lengths: torch.Tensor, blank: int) -> None:
        """CTC log-probabilities (N, T, V) of N hypotheses' utterances and their frame counts (N,)."""
        self.x = log_probs.double().clamp(min=FLOOR).transpose(0, 1).contiguous()  # (T, N, V)
        self.lengths = lengths.to(self.x.device)
        self.xb = self.x[:, :, blank]  # (T, N)
        t = torch.arange(self.x.shape[0], device=self.x.device)
        self.frames = t[:, None] < self.lengths[None, :]  # (T, N)

    def initial(self) -> torch.Tensor:
        """State (T, 2, N) of the empty prefix: log P(prefix, ending in a label | in a blank, at frame t)."""
        return torch.stack([torch.full_like(self.xb, float("-inf")), self.xb.cumsum(0)], 1)

    def complete(self, state: torch.Tensor) -> torch.Tensor:
        """log P(y | x) (N,) of each hypothesis y as the whole label sequence: its state at the last frame."""
        last = (self.lengths - 1).clamp(min=0)
        at_end = state.gather(0, last[None, None, :].expand(1, 2, -1))[0]
        return torch.logaddexp(at_end[0], at_end[1])

    def extend(
        self, state: torch.Tensor, last: torch.Tensor, cand: torch.Tensor, labels: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix log-probabilities (N, C) of each hypothesis, `labels` labels long and last label `last`
        (N,), extended by each of its candidate labels `cand` (N, C); and the extensions' states
        (T, 2, N, C)."""
        steps = self.x.shape[0]
        xc = self.x.gather(2, cand[None].expand(steps, -1, -1))  # (T, N, C)
        either = torch.logaddexp(state[:, 0], state[:, 1])
        # a repeated label needs a blank between the two, else CTC merges them
        phi = torch.where(cand[None] == last[None, :, None], state[:, 1, :, None], either[..., None])
        before = torch.full_like(phi[:1], 0.0 if labels == 0 else float("-inf"))  # phi at frame -1
        shifted = torch.cat([before, phi[:-1]], 0)  # shifted[t] = phi at frame t-1
        prefix = torch.where(self.frames[..., None], shifted + xc, float("-inf")).logsumexp(0)
        # the extension holds labels + 1 labels, so it cannot end before frame `labels`
        label = torch.full_like(xc, float("-inf"))
        blank = torch.full_like(xc, float("-inf"))
        first = max(labels, 1)
        if labels == 0:
            label[0] = xc[0]
        xb = self.xb[..., None]
        for t in range(first, steps):
            label[t] = torch.logaddexp(label[t - 1], phi[t - 1]) + xc[t]
            blank[t] = torch.logaddexp(label[t - 1], blank[t - 1]) + xb[t]
        return prefix, torch.stack([label, blank], 1)


@torch.no_grad()
def joint_beam_search(
    decoder: TransformerDecoder,
    memory: torch.Tensor,
    lengths: torch.Tensor,
    ctc_log_probs: torch.Tensor,
    *,
    beam_size: int,
    ctc_weight: float,
    sos: int,
    eos: int,
    blank: int,
    pre_beam: int | None = None,
) -> list[tuple[list[int], float]]:
    """Best label sequence (without sos/eos) and its joint score per utterance of `memory` (B, T, C) and its
    CTC log-probabilities (B, T, V), both `lengths` (B,) frames long. Hypotheses may not outgrow their
    utterance's frames (CTC could not align them); every utterance is searched in one batch, its `beam_size`
    rows sharing the encoder's keys/values. `pre_beam`: candidates per hypothesis scored with CTC, the best
    attention scores (default ESPnet's 1.5 x beam_size; every token at ctc_weight=1, where attention scores
    carry no weight)."""
    b, k = memory.shape[0], beam_size
    vocab = decoder.vocab_size
    if pre_beam is None:
        pre_beam = vocab if ctc_weight == 1 else max(int(1.5 * k), 2)
    never = {blank, sos} - {eos}  # CTC's blank and the start symbol are never labels
    width = min(vocab - len(never), pre_beam)
    device = memory.device
    lengths = lengths.to(device)
    longest = int(lengths.max())
    room = lengths.repeat_interleave(k)  # at most one label per frame
    cache = decoder.start(memory, lengths, max_len=longest + 1, group=k)
    ctc = _CTCScores(ctc_log_probs.repeat_interleave(k, 0), room, blank) if ctc_weight > 0 else None
    score = torch.full((b, k), float("-inf"), dtype=torch.float64, device=device)
    score[:, 0] = 0.0  # one live hypothesis per utterance to start with
    score = score.flatten()
    last = torch.full((b * k,), sos, dtype=torch.long, device=device)
    tokens = last[:, None]
    ended = torch.zeros(b * k, dtype=torch.bool, device=device)
    base = torch.arange(b, device=device).repeat_interleave(k) * k  # first row of each utterance's beam
    for step in range(longest + 1):
        att = decoder.step(last[:, None], cache)[:, -1].double().log_softmax(-1)
        for symbol in never:
            att[:, symbol] = float("-inf")
        # eos always a candidate (first), then the best attention tokens
        cand = att.index_fill(1, torch.tensor([eos], device=device), float("inf")).topk(width, 1).indices
        # ctc_weight=1 (CTC prefix search alone) keeps att out: 0 * -inf would be NaN
        joint = (
            (1.0 - ctc_weight) * att.gather(1, cand) if ctc_weight < 1 else torch.zeros_like(att[:, :width])
        )
        if ctc is not None:
            joint = joint + ctc_weight * ctc.gains(last, cand, step)
        joint = score[:, None] + joint
        full = (step >= room)[:, None] & (cand != eos)
        joint = joint.masked_fill(full, float("-inf"))
        # a finished hypothesis keeps its place and score, extended by eos only
        joint[ended] = float("-inf")
        joint[ended, 0] = score[ended]
        top = joint.view(b, k * width).topk(k, 1)
        src = base + (top.indices // width).flatten()
        pick = (top.indices % width).flatten()
        new = cand[src, pick]
        score = top.values.flatten()
        ended = ended[src] | (new == eos)
        if ctc is not None:
            ctc.keep(src, pick)
        cache.reorder(src)
        tokens = torch.cat([tokens[src], new[:, None]], 1)
        last = new
        if bool(ended.all()):
            break
    return _best_sequences(score.view(b, k), tokens, eos)


class _CTCScores:
    """The CTC side of the joint search: each hypothesis's prefix state and log-probability, and what each
    candidate extension gains by CTC."""

    def __init__(self, log_probs: torch.Tensor, room: torch.Tensor, blank: int) -> None:
        """CTC log-probabilities (rows, T, V) of every beam row's utterance and its frame counts (rows,)."""
        self.scorer = CTCPrefixScorer(log_probs, room, blank)
        self.state = self.scorer.initial()
        self.prefix_prev = torch.zeros(log_probs.shape[0], dtype=torch.float64, device=room.device)

    def gains(self, last: torch.Tensor, cand: torch.Tensor, step: int) -> torch.Tensor:
        """(rows, C) CTC prefix log-probability each extension by `cand` gains; cand[:, 0] is eos, scored as
        the hypothesis as a whole sequence."""
        self.prefix, self.ext = self.scorer.extend(self.state, last, cand, labels=step)
        self.prefix[:, 0] = self.scorer.complete(self.state)
        gain = self.prefix - self.prefix_prev[:, None]
        # an impossible hypothesis (-inf already) gains nothing: -inf - -inf would be NaN
        return torch.where(self.prefix_prev[:, None].isfinite(), gain, 0.0)

    def keep(self, src: torch.Tensor, pick: torch.Tensor) -> None:
        """Keep the extensions the beam chose: candidate `pick` of row `src`, per new row."""
        self.state = self.ext[:, :, src, pick]
        self.prefix_prev = self.prefix[src, pick]


def _best_sequences(score: torch.Tensor, tokens: torch.Tensor, eos: int) -> list[tuple[list[int], float]]:
    """Per utterance of `score` (B, k), its best row's labels in `tokens` (sos and eos dropped) and score."""
    k = score.shape[1]
    best = score.argmax(1)
    out = []
    for i in range(score.shape[0]):
        row = i * k + int(best[i])
        ids = tokens[row, 1:].tolist()
        out.append((ids[: ids.index(eos)] if eos in ids else ids, float(score[i, int(best[i])])))
    return out
