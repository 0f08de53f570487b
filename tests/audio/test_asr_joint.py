"""Joint CTC/attention ASR (model.attention_decoder_layers, task.ctc_weight, task.decoder=joint): the loss's
arithmetic, a few training steps on one batch, joint decoding, export of the encoder+CTC path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from audio.asr import ASRTask
from audio.scoring import english_normalizer
from core.errors import ConfigError
from tests.helpers import fault

#: the normalised rates every evaluation reports beside the raw ones (with whisper-normalizer)
NORMALIZED = {"wer_normalized", "cer_normalized"} if english_normalizer() else set()
TINY = {"name": "conformer_ctc_xs", "dim": 64, "layers": 2, "heads": 2, "subsampling_channels": 16}
JOINT = {**TINY, "attention_decoder_layers": 1}
TEXTS = ["yes", "go left", "stop now", "no"]
# the task's own CTC term against torch's CTC: same call, same inputs
TOL = 1e-6


def task_and_batch(**task_kw) -> tuple[ASRTask, torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny joint model and one batch of 4 noise clips (0.5-0.8 s) labelled with short commands."""
    torch.manual_seed(0)
    task = ASRTask(model=JOINT, data={"name": "espeak_words"}, spec_augment=False, freq_warp=0.0, **task_kw)
    model = task.build_model()
    samples = [8000, 12800, 11000, 9600]
    audio = torch.randn(4, max(samples)) * 0.1
    targets = [torch.tensor(task.tokenizer.encode(t)) for t in TEXTS]
    batch = {
        "audio": audio * (torch.arange(audio.shape[1])[None] < torch.tensor(samples)[:, None]),
        "audio_lengths": torch.tensor(samples),
        "targets": torch.nn.utils.rnn.pad_sequence(targets, batch_first=True),
        "target_lengths": torch.tensor([len(t) for t in targets]),
    }
    return task, model, batch


def test_plain_ctc_model_is_unchanged_and_joint_needs_a_decoder() -> None:
    plain = ASRTask(model=TINY, data={"name": "espeak_words"}).build_model()
    assert not any("attention_decoder" in k for k in plain.state_dict())
    with pytest.raises(ConfigError) as e:
        ASRTask(model=TINY, data={"name": "espeak_words"}, decoder="joint").build_model()
    assert fault(e.value) == ("task.decoder", "joint", ("model.attention_decoder_layers>=1",))


def test_joint_loss_is_the_weighted_sum_of_ctc_and_smoothed_cross_entropy() -> None:
    task, model, batch = task_and_batch(ctc_weight=0.3, label_smoothing=0.1)
    batch = task.on_device(model.eval(), batch)
    out = task.step(model, batch)
    loss = out.loss
    # by hand: <sos>=<eos>=0, per-utterance token means of the decoder's cross-entropy
    inputs = [[0, *task.tokenizer.encode(t)] for t in TEXTS]
    padded = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in inputs], batch_first=True)
    log_probs, lengths, logits = model(batch["features"], batch["feature_lengths"], padded)
    ce = torch.stack(
        [
            F.cross_entropy(logits[b, : len(i)], torch.tensor([*i[1:], 0]), label_smoothing=0.1)
            for b, i in enumerate(inputs)
        ]
    ).mean()
    ctc = F.ctc_loss(
        log_probs.transpose(0, 1), batch["targets"], lengths, batch["target_lengths"], zero_infinity=True
    )
    assert abs(float(loss.detach()) - float((0.3 * ctc + 0.7 * ce).detach())) < TOL
    assert abs(float(out.metrics["ctc_loss"]) - float(ctc)) < TOL
    assert abs(float(out.metrics["attention_loss"]) - float(ce)) < TOL


def test_a_few_steps_lower_the_joint_loss_and_joint_decoding_reads_the_batch() -> None:
    task, model, batch = task_and_batch(decoder="joint", beam_size=4)
    features = task.on_device(model.train(), dict(batch))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(240):
        loss = task.step(model, features).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert max(losses[-10:]) < 0.5 * min(losses[:10]), losses[::20]
    out = task.evaluate(model.eval(), [batch])
    rates = {"wer", "cer", "greedy_wer", "greedy_cer"} | NORMALIZED
    assert set(out) == {"loss", "ctc_loss", "attention_loss"} | rates
    assert abs(out["loss"] - (0.3 * out["ctc_loss"] + 0.7 * out["attention_loss"])) < 1e-5
    # one memorised batch: the joint search reads it back (greedy CTC alone still misspells at this point)
    assert out["wer"] == 0.0, out
    assert task.transcribe_batch(model, [batch["audio"][1, :12800]]) == ["go left"]


def test_decoder_equipped_model_exports_its_encoder_ctc_path_and_decoder() -> None:
    task, model, batch = task_and_batch()
    model.eval()
    inputs = task.export_inputs(model, batch)
    assert inputs.outputs == ("log_probs", "frames", "encoder_out")
    program = torch.export.export(inputs.module, inputs.args, dynamic_shapes=inputs.dynamic_shapes)
    shorter = (batch["audio"][:2, :9000], batch["audio_lengths"][:2].clamp(max=9000))
    for args in (inputs.args, shorter):
        want = inputs.module(*args)
        got = program.module()(*args)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(want, got, strict=True))
    # the decoder, exported on the main program's encoder output: the training forward's logits, at any
    # batch size, token count and encoder length
    (name, part), *others = task.export_parts(model, batch).items()
    assert name == "decoder" and not others and part.names == ("tokens", "encoder_out", "frames")
    decoder = torch.export.export(part.module, part.args, dynamic_shapes=part.dynamic_shapes).module()
    on_device = task.on_device(model, batch)
    with torch.no_grad():
        _, frames, encoder_out = program.module()(*inputs.args)
        tokens = part.args[0]  # <sos> + each transcript
        want = model(on_device["features"], on_device["feature_lengths"], tokens)[2]  # the training forward's
        torch.testing.assert_close(decoder(tokens, encoder_out, frames), want, rtol=1e-4, atol=1e-5)
        _, frames, encoder_out = program.module()(*shorter)
        for n in (1, 3):  # from <sos> alone, as a caller decoding token by token starts
            got = decoder(tokens[:2, :n], encoder_out, frames)
            want = model.attention_decoder(tokens[:2, :n], encoder_out, frames)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert got.shape == (2, n, model.vocab_size)
    plain = ASRTask(model=TINY, data={"name": "espeak_words"})
    assert plain.export_parts(plain.build_model().eval(), batch) == {}
