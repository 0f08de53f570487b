"""The GPT: packed documents are independent, weights are tied, seeded sampling is reproducible."""

from __future__ import annotations

import io

import pytest
import torch

from core import checkpoint
from tests.core.qkv_layout import old_qkv_layout
from text.generation import generate
from text.gpt import GPT


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=40, context=32, n_layer=2, n_head=2, d_model=16, dropout=0.0, bias=False).eval()


def test_changing_one_packed_document_leaves_the_others_unchanged() -> None:
    model = tiny()
    g = torch.Generator().manual_seed(1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 15 + [2] * 7, [3] * 5 + [4] * 27])
    tokens = torch.randint(0, 40, (2, 32), generator=g)
    changed = tokens.clone()
    changed[doc_ids == 1] = torch.randint(0, 40, (15,), generator=g)
    with torch.no_grad():
        before, after = model(tokens, doc_ids), model(changed, doc_ids)
    other = doc_ids != 1
    # Same shapes, same kernels: only float reassociation could differ, so a tight fp32 tolerance.
    torch.testing.assert_close(after[other], before[other], atol=1e-6, rtol=1e-5)
    assert (after[~other] - before[~other]).abs().max() > 1e-3  # the edited document itself did change


def test_each_packed_document_equals_running_it_alone() -> None:
    model = tiny()
    doc_ids = torch.tensor([[0] * 10 + [1] * 15 + [2] * 7])
    tokens = torch.randint(0, 40, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(tokens, doc_ids)
        for d in range(3):
            sel = doc_ids[0] == d
            alone = model(tokens[:, sel])  # reference: the document by itself, plain causal attention
            torch.testing.assert_close(packed[0, sel], alone[0], atol=1e-5, rtol=1e-5)


def test_single_document_rows_take_the_plain_causal_path() -> None:
    model = tiny()
    tokens = torch.randint(0, 40, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.zeros_like(tokens)), model(tokens), atol=0, rtol=0)


def test_weights_are_tied_and_survive_a_state_dict_round_trip() -> None:
    model = GPT(vocab_size=40, context=32, n_layer=1, n_head=2, d_model=16)
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in model.state_dict().values())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = GPT(vocab_size=40, context=32, n_layer=1, n_head=2, d_model=16)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert fresh.head.weight is fresh.tok_emb.weight
    torch.testing.assert_close(fresh.head.weight, model.head.weight, atol=0, rtol=0)


def test_seeded_generation_is_deterministic() -> None:
    model = tiny()
    prompt = torch.tensor([1, 2, 3])

    def sample(seed: int) -> list[int]:
        return generate(
            model, prompt, 24, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed)
        ).tolist()

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)  # 24 draws over 20 tokens: equal only by a tiny coincidence
    assert len(sample(7)) == 24


def test_greedy_generation_follows_the_argmax_and_stops_at_eos() -> None:
    model = tiny()
    prompt = torch.tensor([1, 2, 3])
    out = generate(model, prompt, 5, temperature=0.0).tolist()
    with torch.no_grad():
        first = int(model(prompt[None])[0, -1].argmax())
    assert out[0] == first
    assert generate(model, prompt, 5, temperature=0.0, eos_id=first).tolist() == []


def test_compiled_gpt_over_varying_packings_matches_eager_and_stops_recompiling() -> None:
    from core import compile as kc

    torch._dynamo.reset()
    model, ref = tiny(), tiny()
    kc.apply(model.train(), kc.CompileConfig(policy="full"), backend="eager")  # dynamo only: fast
    g = torch.Generator().manual_seed(3)
    try:
        for i in range(12):  # rows with 1..4 documents each, boundaries moving every batch
            cuts = sorted(torch.randperm(31, generator=g)[: i % 4].add(1).tolist())
            row = torch.zeros(32, dtype=torch.long)
            for c in cuts:
                row[c:] += 1
            doc_ids = torch.stack([row, row.flip(0).max() - row.flip(0)])
            tokens = torch.randint(0, 40, (2, 32), generator=g)
            torch.testing.assert_close(model(tokens, doc_ids), ref.train()(tokens, doc_ids))
        metrics = kc.compile_metrics()
        # segment finding and the per-segment attention run eager between compiled pieces, so new segment
        # counts do not recompile them (before they did, once per count and per layer)
        assert metrics["compile/recompiles"] <= 3, metrics
        assert model.compile_report.compiled == "full"
    finally:
        torch._dynamo.reset()


def test_checkpoints_with_the_old_qkv_layout_load_to_identical_logits(tmp_path) -> None:
    from safetensors.torch import load_model, save_file

    src = tiny(seed=4)
    old = old_qkv_layout(src.state_dict(), n_head=2)
    tokens = torch.randint(0, 40, (2, 32), generator=torch.Generator().manual_seed(5))
    via_checkpoint, via_safetensors = tiny(seed=6), tiny(seed=7)
    checkpoint.load_model_state(via_checkpoint, old, "old.pt")  # the trainer's resume path
    save_file({k: v for k, v in old.items() if k != "head.weight"}, tmp_path / "model.safetensors")
    load_model(via_safetensors, tmp_path / "model.safetensors")  # generate's exported-weights path
    with torch.no_grad():
        want = src(tokens)
        for model in (via_checkpoint, via_safetensors):
            torch.testing.assert_close(model(tokens), want, atol=0, rtol=0)  # same weights, same kernels


@pytest.mark.parametrize("bias", [False, True])
def test_training_flops_of_the_gpt_are_the_closed_form(bias: bool) -> None:
    """torch's flop counter (core.logging.throughput's attention rule) against 6N + 12 L d T per token (PaLM's
    appendix B, nanoGPT's estimate_mfu): N the matmul weights (the tied head included, embeddings not)."""
    from core.logging.throughput import count_flops

    n_layer, n_head, d, vocab, context, batch = 3, 4, 32, 61, 24, 2
    model = GPT(vocab_size=vocab, context=context, n_layer=n_layer, n_head=n_head, d_model=d, bias=bias)
    x = torch.randint(0, vocab, (batch, context))
    flops = count_flops(lambda: model(x).float().sum().backward())
    n = n_layer * 12 * d * d + d * vocab
    assert flops == batch * context * (6 * n + 12 * n_layer * d * context)
