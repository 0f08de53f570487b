"""Pretrained speech encoders (audio/wav2vec2.py): tiny random encoders saved in torchaudio's, fairseq's and
Hugging Face's layouts load strictly and fine-tune; a file of other sizes is one typed error; the export takes
raw audio. The fairseq and Hugging Face files are written here from those projects' own key names (spelled
out below, not derived from the loader's maps), so the loader's renaming is checked against them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from audio.asr import ASRTask
from audio.pretrained import build_encoder_ctc
from audio.wav2vec2 import Wav2Vec2CTC, time_mask
from core.errors import CheckpointError, ConfigError
from core.optim import OptimConfig, build_optimizer
from tests.helpers import fault, tone_manifest

TINY = {
    "conv_layers": ((16, 10, 5), (16, 3, 2), (16, 2, 2)),
    "dim": 32,
    "layers": 2,
    "heads": 2,
    "ff_dim": 64,
    "pos_conv_kernel": 8,
    "pos_conv_groups": 4,
    "num_buckets": 16,
    "max_distance": 64,
}
ARCHS = ("wav2vec2", "hubert", "wavlm")
LAYOUTS = ("torchaudio", "fairseq", "huggingface")


def _source(arch: str, **sizes: object) -> Wav2Vec2CTC:
    torch.manual_seed(1)
    return Wav2Vec2CTC(arch=arch, **{**TINY, **sizes})


def _split_qkv(state: dict[str, torch.Tensor], old: str, new: str) -> None:
    """torchaudio's joined WavLM in_proj (q, k, v stacked) as the separate q/k/v_proj the others save."""
    for part in ("weight", "bias"):
        q, k, v = state.pop(f"{old}in_proj_{part}").chunk(3)
        state |= {f"{new}q_proj.{part}": q, f"{new}k_proj.{part}": k, f"{new}v_proj.{part}": v}
    for part in ("weight", "bias"):
        state[f"{new}out_proj.{part}"] = state.pop(f"{old}out_proj.{part}")


def huggingface_state(m: Wav2Vec2CTC) -> dict[str, torch.Tensor]:
    """What transformers' Wav2Vec2ForCTC / HubertForCTC / WavLMForCTC save: the encoder under `wav2vec2.` /
    `hubert.` / `wavlm.`, feature_projection beside encoder, weight norm as weight_g/weight_v, lm_head."""
    prefix = m.arch
    out: dict[str, torch.Tensor] = {f"{prefix}.masked_spec_embed": m.mask_embedding.detach().clone()}
    for k, v in m.state_dict().items():
        if k.startswith("feature_extractor."):
            out[f"{prefix}.{k}"] = v
        elif k.startswith("encoder.feature_projection."):
            out[f"{prefix}.{k.removeprefix('encoder.')}"] = v
        elif k.startswith("encoder.transformer."):
            if m.arch != "wavlm":  # transformers before 4.37 saved weight norm's parts under these names
                k = k.replace("parametrizations.weight.original0", "weight_g")
                k = k.replace("parametrizations.weight.original1", "weight_v")
            out[f"{prefix}.encoder.{k.removeprefix('encoder.transformer.')}"] = v
    if m.arch == "wavlm":
        for i in range(len(m.encoder.transformer.layers)):
            a = f"{prefix}.encoder.layers.{i}.attention."
            _split_qkv(out, f"{a}attention.", a)
    out |= {"lm_head.weight": torch.randn(40, TINY["dim"]), "lm_head.bias": torch.randn(40)}
    return out


def fairseq_state(m: Wav2Vec2CTC, finetuned: bool) -> dict[str, torch.Tensor]:
    """What fairseq's Wav2Vec2Model / HubertModel (and microsoft/unilm's WavLM) keep under "model": conv
    layers as Sequential indices, post_extract_proj, encoder.pos_conv.0, self_attn/fc1/fc2; a fine-tuned
    Wav2VecEncoder puts it all under w2v_encoder.w2v_model. beside its head w2v_encoder.proj."""
    out: dict[str, torch.Tensor] = {"mask_emb": m.mask_embedding.detach().clone()}
    names = [
        ("feature_extractor.conv_layers.{}.conv.", "feature_extractor.conv_layers.{}.0."),
        ("feature_extractor.conv_layers.{}.layer_norm.", "feature_extractor.conv_layers.{}.2."),
        ("encoder.transformer.layers.{}.attention.", "encoder.layers.{}.self_attn."),
        ("encoder.transformer.layers.{}.layer_norm.", "encoder.layers.{}.self_attn_layer_norm."),
        ("encoder.transformer.layers.{}.feed_forward.intermediate_dense.", "encoder.layers.{}.fc1."),
        ("encoder.transformer.layers.{}.feed_forward.output_dense.", "encoder.layers.{}.fc2."),
        ("encoder.transformer.layers.{}.final_layer_norm.", "encoder.layers.{}.final_layer_norm."),
    ]
    pos = "encoder.transformer.pos_conv_embed.conv."
    fixed = {
        "encoder.feature_projection.layer_norm.": "layer_norm.",
        "encoder.feature_projection.projection.": "post_extract_proj.",
        f"{pos}parametrizations.weight.original0": "encoder.pos_conv.0.weight_g",
        f"{pos}parametrizations.weight.original1": "encoder.pos_conv.0.weight_v",
        f"{pos}bias": "encoder.pos_conv.0.bias",
        "encoder.transformer.layer_norm.": "encoder.layer_norm.",
        "attention.rel_attn_embed.": "self_attn.relative_attention_bias.",
        "attention.gru_rel_pos_linear.": "self_attn.grep_linear.",
        "attention.gru_rel_pos_const": "self_attn.grep_a",
    }
    for k, v in m.state_dict().items():
        if not k.startswith(("feature_extractor.", "encoder.")):
            continue
        new = k
        for ours, theirs in fixed.items():
            if ours in new:
                new = new.replace(ours, theirs)
                break
        else:
            for ours, theirs in names:
                for i in range(8):
                    if new.startswith(ours.format(i)):
                        new = theirs.format(i) + new.removeprefix(ours.format(i))
        new = new.replace("encoder.transformer.layers.", "encoder.layers.")
        out[new] = v
    if m.arch == "wavlm":
        for i in range(len(m.encoder.transformer.layers)):
            a = f"encoder.layers.{i}.self_attn."
            _split_qkv(out, f"{a}attention.", a)
    out |= {"quantizer.vars": torch.randn(1, 8, 4), "project_q.weight": torch.randn(4, 4)}
    out |= {"final_proj.weight": torch.randn(8, TINY["dim"])}
    if finetuned:
        out = {f"w2v_encoder.w2v_model.{k}": v for k, v in out.items()}
        out |= {
            "w2v_encoder.proj.weight": torch.randn(32, TINY["dim"]),
            "w2v_encoder.proj.bias": torch.randn(32),
        }
    return out


def save(m: Wav2Vec2CTC, layout: str, folder: Path) -> Path:
    """`m`'s encoder written as `layout` saves it: torchaudio's state dict (.pth, with another vocabulary's
    aux head), fairseq's checkpoint dict (.pt: cfg + model) or Hugging Face's model.safetensors."""
    from safetensors.torch import save_file

    if layout == "torchaudio":
        state = {k: v for k, v in m.state_dict().items() if k.startswith(("feature_extractor.", "encoder."))}
        path = folder / "torchaudio.pth"
        torch.save({**state, "aux.weight": torch.randn(31, TINY["dim"]), "aux.bias": torch.randn(31)}, path)
    elif layout == "fairseq":
        path = folder / "fairseq.pt"
        cfg = {"model": {"_name": m.arch, "encoder_layers": TINY["layers"]}}
        torch.save({"cfg": cfg, "model": fairseq_state(m, finetuned=m.arch == "hubert")}, path)
    else:
        path = folder / "model.safetensors"
        save_file({k: v.contiguous() for k, v in huggingface_state(m).items()}, str(path))
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_layout_loads_the_encoder_exactly_and_starts_a_new_head(
    tmp_path: Path, arch: str, layout: str, caplog
) -> None:
    src = _source(arch)
    path = save(src, layout, tmp_path)
    torch.manual_seed(2)
    with caplog.at_level(logging.INFO, logger="audio"):
        m = build_encoder_ctc(arch=arch, weights=str(path), **TINY)
    got, want = m.state_dict(), src.state_dict()
    for k, v in want.items():
        if not k.startswith("head.") and (k != "mask_embedding" or layout != "torchaudio"):
            assert torch.equal(got[k], v), k  # copied: exact (torchaudio's layout has no mask embedding)
    assert not torch.equal(got["head.weight"], want["head.weight"])  # new, from the seed
    assert m.head.out_features == 29
    x, lengths = torch.randn(2, 4000), torch.tensor([4000, 2500])
    with torch.no_grad():  # same encoder, same features: the head's input is the source's
        assert torch.equal(
            m.eval()._encode(*m.feature_extractor(x, lengths)),
            src.eval()._encode(*src.feature_extractor(x, lengths)),
        )
    record = next(r for r in caplog.records if r.getMessage().startswith("model.weights:"))
    assert f"({layout} layout)" in record.getMessage() and "head.weight" in record.getMessage()


def test_a_file_of_other_sizes_is_one_typed_error_naming_the_first_mismatches(tmp_path: Path) -> None:
    path = save(_source("wav2vec2", ff_dim=48), "huggingface", tmp_path)
    with pytest.raises(CheckpointError) as e:
        build_encoder_ctc(arch="wav2vec2", weights=str(path), **TINY)
    key, value, first = fault(e.value)
    assert (key, value) == ("model.weights", str(path))
    assert first[0].startswith(
        "encoder.transformer.layers.0.feed_forward.intermediate_dense.weight is (48, 32)"
    )
    assert "\n" not in str(e.value)
    # a WavLM file read as wav2vec2: WavLM joins q/k/v into one in_proj, so wav2vec2's k_proj is missing
    path = save(_source("wavlm"), "torchaudio", tmp_path)
    with pytest.raises(CheckpointError) as e:
        build_encoder_ctc(arch="wav2vec2", weights=str(path), **TINY)
    assert fault(e.value)[2][0].startswith("encoder.transformer.layers.0.attention.k_proj.weight missing")


def test_a_file_of_no_known_layout_is_refused(tmp_path: Path) -> None:
    torch.save({"backbone.weight": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(CheckpointError) as e:
        build_encoder_ctc(weights=str(tmp_path / "x.pt"), **TINY)
    assert fault(e.value) == ("model.weights", str(tmp_path / "x.pt"), LAYOUTS)


def huggingface_config(arch: str, **changes: object) -> dict[str, object]:
    """A transformers config.json of the TINY sizes, in Wav2Vec2Config's / WavLMConfig's field names."""
    conv = TINY["conv_layers"]
    config = {
        "model_type": arch,
        "hidden_size": TINY["dim"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "intermediate_size": TINY["ff_dim"],
        "conv_dim": [c for c, _, _ in conv],
        "conv_kernel": [k for _, k, _ in conv],
        "conv_stride": [s for _, _, s in conv],
        "conv_bias": False,
        "feat_extract_norm": "group",
        "num_conv_pos_embeddings": TINY["pos_conv_kernel"],
        "num_conv_pos_embedding_groups": TINY["pos_conv_groups"],
        "do_stable_layer_norm": False,
        "num_buckets": TINY["num_buckets"],
        "max_bucket_distance": TINY["max_distance"],
        "hidden_dropout": 0.1,  # a fine-tuning setting: not taken from the file
    }
    return {**config, **changes}


def fairseq_model_config(arch: str) -> dict[str, object]:
    """fairseq's Wav2Vec2Config / HubertConfig fields (unilm's WavLMConfig adds the relative position ones)
    for the TINY sizes, conv_feature_layers spelled as fairseq's configs spell it."""
    config = {
        "_name": arch,
        "extractor_mode": "default",
        "conv_feature_layers": "[(16, 10, 5)] + [(16, 3, 2)] * 1 + [(16, 2, 2)]",
        "conv_bias": False,
        "encoder_embed_dim": TINY["dim"],
        "encoder_layers": TINY["layers"],
        "encoder_attention_heads": TINY["heads"],
        "encoder_ffn_embed_dim": TINY["ff_dim"],
        "conv_pos": TINY["pos_conv_kernel"],
        "conv_pos_groups": TINY["pos_conv_groups"],
        "layer_norm_first": False,
        "dropout": 0.1,
    }
    if arch == "wavlm":
        config |= {"relative_position_embedding": True, "num_buckets": 16, "max_distance": 64}
    return config


def _encoders_equal(got: Wav2Vec2CTC, want: Wav2Vec2CTC) -> bool:
    g, w = got.state_dict(), want.state_dict()
    return all(torch.equal(g[k], v) for k, v in w.items() if not k.startswith("head."))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_hugging_face_folder_builds_the_encoder_to_its_config_json(
    tmp_path: Path, arch: str, caplog
) -> None:
    src = _source(arch)
    save(src, "huggingface", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(huggingface_config(arch)))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_normalize": True}))
    for weights in (tmp_path, tmp_path / "model.safetensors"):  # the folder, or its weights file
        with caplog.at_level(logging.INFO, logger="audio"):
            m = build_encoder_ctc(
                arch=arch, weights=str(weights)
            )  # the base sizes by default: the file's win
        assert _encoders_equal(m, src)
        assert (m.encoder.feature_projection.projection.out_features, len(m.encoder.transformer.layers)) == (
            32,
            2,
        )
        assert m.normalize_audio and m.conv_layers == TINY["conv_layers"]
        assert m.file_sizes["dim"] == 32 and m.file_sizes["conv_layers"] == TINY["conv_layers"]
        assert (
            "model.dim=32" in caplog.text and "model.conv_layers=[[16,10,5],[16,3,2],[16,2,2]]" in caplog.text
        )
    # an other family's folder, or a WavLM folder read as wav2vec2: one line naming the key to change
    (tmp_path / "config.json").write_text(json.dumps(huggingface_config("data2vec-audio")))
    with pytest.raises(ConfigError) as e:
        build_encoder_ctc(arch=arch, weights=str(tmp_path))
    assert fault(e.value) == ("model.weights", str(tmp_path), ARCHS)
    other = "wav2vec2" if arch == "wavlm" else "wavlm"
    (tmp_path / "config.json").write_text(json.dumps(huggingface_config(other)))
    with pytest.raises(ConfigError) as e:
        build_encoder_ctc(arch=arch, weights=str(tmp_path))
    assert fault(e.value) == ("model.arch", arch, (other,))
    (tmp_path / "config.json").write_text(json.dumps(huggingface_config(arch, num_hidden_layers=0)))
    with pytest.raises(CheckpointError) as e:
        build_encoder_ctc(arch=arch, weights=str(tmp_path))
    assert fault(e.value) == ("model.weights", str(tmp_path), ("model.layers",))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_fairseq_checkpoint_builds_the_encoder_to_its_cfg_or_args(tmp_path: Path, arch: str) -> None:
    import argparse

    src = _source(arch)
    state = fairseq_state(src, finetuned=False)
    model_cfg = fairseq_model_config(arch)
    new = tmp_path / "new.pt"  # fairseq >= 0.10: cfg as plain containers, the task's normalize beside it
    torch.save({"cfg": {"model": model_cfg, "task": {"normalize": True}}, "model": state}, new)
    old = tmp_path / "old.pt"  # older files: an argparse Namespace; a fine-tuned one nests its pretraining's
    w2v_args = argparse.Namespace(**model_cfg, normalize=False)
    finetuned = fairseq_state(src, finetuned=True)
    torch.save({"args": argparse.Namespace(_name=f"{arch}_ctc", w2v_args=w2v_args), "model": finetuned}, old)
    for path, normalize in ((new, True), (old, False)):
        m = build_encoder_ctc(arch=arch, weights=str(path))
        assert _encoders_equal(m, src) and m.normalize_audio is normalize
        assert m.file_sizes["conv_layers"] == TINY["conv_layers"]
    # the conv layers' expression is read, never run: anything but literals, + and * is refused
    hostile = {**model_cfg, "conv_feature_layers": "__import__('os').getcwd()"}
    torch.save({"cfg": {"model": hostile}, "model": state}, new)
    with pytest.raises(CheckpointError) as e:
        build_encoder_ctc(arch=arch, weights=str(new))
    assert fault(e.value) == ("model.weights", str(new), ("model.conv_layers",))


def test_an_asr_run_keeps_the_file_s_sizes_for_its_checkpoints(tmp_path: Path) -> None:
    src = _source("wav2vec2")
    folder = tmp_path / "pretrained"
    folder.mkdir()
    save(src, "huggingface", folder)
    (folder / "config.json").write_text(json.dumps(huggingface_config("wav2vec2")))
    spec = {"model": {"name": "wav2vec2_ctc", "weights": str(folder)}, "data": {"name": "manifest"}}
    task = ASRTask(**spec, speed_perturb=())
    trained = task.build_model()
    task.save_artifacts(tmp_path)
    assert json.loads((tmp_path / "pretrained_sizes.json").read_text())["dim"] == 32
    (folder / "model.safetensors").unlink()  # a finished run needs only its own directory
    again = ASRTask(**spec, speed_perturb=())
    again.load_artifacts(tmp_path)
    rebuilt = again.build_model()
    rebuilt.load_state_dict(trained.state_dict(), strict=True)  # the same shapes: the file's, not the base's
    (tmp_path / "pretrained_sizes.json").write_text(json.dumps({"dim": 32, "__class__": "os.system"}))
    with pytest.raises(CheckpointError) as e:
        ASRTask(**spec, speed_perturb=()).load_artifacts(tmp_path)
    assert fault(e.value)[:2] == ("checkpoint", str(tmp_path / "pretrained_sizes.json"))


def test_time_masks_cover_about_the_asked_fraction_of_real_frames_only() -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([1000] * 50 + [400] * 50)
    mask = time_mask(lengths, 1000, 0.65, 10)
    assert not mask[50:, 400:].any()  # padding never masked
    fraction = mask[:50].float().mean().item()
    assert abs(fraction - (1 - torch.exp(torch.tensor(-0.65)).item())) < 0.03  # ~0.478, 50k frames


def test_fine_tuning_practice_freezes_scales_and_counts_steps(tmp_path: Path) -> None:
    m = _source("wav2vec2", freeze_encoder_steps=2, encoder_lr_scale=0.1)
    assert not any(p.requires_grad for p in m.feature_extractor.parameters())
    opt = build_optimizer(m, OptimConfig(lr=1e-3))
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lrs[id(m.head.weight)] == 1e-3 and lrs[id(m.head.bias)] == 1e-3
    assert lrs[id(m.encoder.transformer.layers[0].attention.k_proj.weight)] == pytest.approx(1e-4)
    assert lrs[id(m.mask_embedding)] == pytest.approx(1e-4)
    assert id(m.feature_extractor.conv_layers[0].conv.weight) not in lrs  # frozen: not optimized at all
    x, lengths = torch.randn(2, 4000), torch.tensor([4000, 3000])
    m.train()
    m(x, lengths)[0].sum().backward()
    assert m.head.weight.grad is not None and m.encoder.feature_projection.projection.weight.grad is None
    m.zero_grad(set_to_none=True)
    m.set_num_updates(2)  # from freeze_encoder_steps on, the encoder trains
    m(x, lengths)[0].sum().backward()
    assert m.encoder.feature_projection.projection.weight.grad is not None
    assert m.feature_extractor.conv_layers[0].conv.weight.grad is None


def test_layer_drop_follows_the_step_not_the_global_rng() -> None:
    m = _source("wavlm", layers=8, layer_drop=0.5)
    m.set_num_updates(7)
    first = [m._dropped_layers(8) for _ in range(3)]
    torch.manual_seed(123)  # another rank's (or a resumed run's) global RNG state
    m.set_num_updates(7)
    assert [m._dropped_layers(8) for _ in range(3)] == first  # micro-batches of step 7, on any rank
    assert len({frozenset(d) for d in first}) > 1  # each micro-batch draws anew
    assert all(0 not in d for d in first)  # WavLM's position-bias layer always runs
    m.set_num_updates(0)
    skipped = [len(m._dropped_layers(8)) for _ in range(200)]
    assert abs(sum(skipped) / (200 * 7) - 0.5) < 0.05  # 7 droppable layers at p=0.5 (1400 draws)


def test_normalized_audio_ignores_gain_and_leaves_padding_silent() -> None:
    m = _source("wav2vec2", normalize_audio=True, extractor_mode="layer_norm").eval()
    x, lengths = torch.randn(2, 4000), torch.tensor([4000, 2500])
    x[1, 2500:] = 0
    with torch.no_grad():
        a, b = m(x, lengths)[0], m(x * 7.0, lengths)[0]
        alone = m(x[1:, :2500], lengths[1:])[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32; the statistics absorb the gain
    torch.testing.assert_close(a[1, : alone.shape[1]], alone[0], rtol=1e-4, atol=1e-4)  # padding unseen


def test_the_trainer_tells_the_model_its_step_so_the_encoder_waits(tmp_path: Path) -> None:
    from core.loop.callbacks import Callback
    from core.loop.trainer import Trainer, TrainerConfig

    manifest = tone_manifest(tmp_path, 8, ("yes", "no"))
    path = save(_source("wav2vec2"), "fairseq", tmp_path)
    task = ASRTask(
        model={"name": "wav2vec2_ctc", "weights": str(path), "freeze_encoder_steps": 2, **TINY},
        data={"name": "manifest", "train": str(manifest), "val": str(manifest)},
        speed_perturb=(),
    )

    class Snapshots(Callback):
        """The projection's weight after each step."""

        seen: list[torch.Tensor] = []

        def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
            w = trainer.model.encoder.feature_projection.projection.weight
            self.seen.append(w.detach().clone())

    cfg = TrainerConfig(max_steps=3, batch_size=8, log_every=1000, progress=False, eval_every=0)
    Trainer(
        task, cfg, OptimConfig(lr=1e-3), run_dir=tmp_path / "run", device="cpu", callbacks=[Snapshots()]
    ).fit()
    start = _source("wav2vec2").encoder.feature_projection.projection.weight.detach()
    first, second, third = Snapshots.seen
    assert torch.equal(first, start) and torch.equal(second, start)  # steps 0 and 1: only the head trains
    assert not torch.equal(third, start)  # step 2 = freeze_encoder_steps: the encoder trains


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_loaded_encoder_fine_tunes_to_a_falling_loss(tmp_path: Path, layout: str) -> None:
    arch = {"torchaudio": "wav2vec2", "fairseq": "hubert", "huggingface": "wavlm"}[layout]
    path = save(_source(arch), layout, tmp_path)
    manifest = tone_manifest(tmp_path, 8, ("yes", "no"))
    torch.manual_seed(0)
    task = ASRTask(
        model={"name": f"{arch}_ctc", "weights": str(path), "freeze_encoder_steps": 5, **TINY},
        data={"name": "manifest", "train": str(manifest), "val": str(manifest)},
        speed_perturb=(),
    )
    model = task.build_model()
    train, _ = task.build_datasets()
    batch = task.collate_fn()([train[i] for i in range(len(train))])
    opt = build_optimizer(model, OptimConfig(lr=3e-3, weight_decay=0.0))
    losses = []
    model.train()
    for step in range(12):
        model.set_num_updates(step)
        loss = task.step(model, task.on_device(model, batch)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # the encoder frozen for 5 steps, then all of it training: ~280 -> ~150 (nats per utterance)
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses


@pytest.mark.slow  # ~10 s: torch.export of the WavLM graph
def test_the_exported_model_takes_raw_audio_and_matches_eager(tmp_path: Path) -> None:
    model = _source("wavlm").eval()
    task = ASRTask(model={"name": "wavlm_ctc", **TINY}, data={"name": "manifest"}, speed_perturb=())
    audio, lengths = torch.randn(3, 6000), torch.tensor([6000, 4100, 2000])
    ex = task.export_inputs(model, {"audio": audio, "audio_lengths": lengths})
    assert ex.names == ("audio", "audio_lengths") and ex.module is model
    program = torch.export.export(ex.module, ex.args, dynamic_shapes=ex.dynamic_shapes)
    exported = program.module()
    for a, n in ((audio, lengths), (audio[1:2, :3000], torch.tensor([3000]))):
        with torch.no_grad():
            want, got = model(a, n), exported(a, n)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)  # fp32, same ATen ops
        assert torch.equal(got[1], want[1])


@pytest.mark.slow  # three CLI processes (~70 s on a loaded 2-core host)
def test_cli_refuses_a_wrong_file_with_exit_2_then_trains_and_exports_raw_audio(
    tmp_path: Path, cli_here
) -> None:
    manifest = tone_manifest(tmp_path, 8, ("yes", "no"))
    sizes = [
        "model.conv_layers=[[16,10,5],[16,3,2],[16,2,2]]",
        *(f"model.{k}={TINY[k]}" for k in ("dim", "layers", "heads", "ff_dim", "pos_conv_kernel")),
        f"model.pos_conv_groups={TINY['pos_conv_groups']}",
    ]
    base = ["+task=asr", "model=wav2vec2_ctc", "data=manifest", f"data.train={manifest}"]
    base += [f"data.val={manifest}", "trainer=smoke", "logger=none"]
    wrong = save(_source("wav2vec2", ff_dim=48), "torchaudio", tmp_path)  # a bare state dict: no sizes
    r = cli_here(*base, *sizes, f"model.weights={wrong}", f"hydra.run.dir={tmp_path / 'bad'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 1
    folder = tmp_path / "tiny-wav2vec2"  # a Hugging Face folder: its config.json sizes the encoder
    folder.mkdir()
    good = save(_source("wav2vec2"), "huggingface", folder)
    (folder / "config.json").write_text(json.dumps(huggingface_config("wav2vec2")))
    r = cli_here(*base, f"model.weights={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    good.rename(tmp_path / "elsewhere.safetensors")  # the run's own weights are all a finished run needs
    r = cli_here(f"ckpt={tmp_path / 'run'}", "format=torch_export", module="recipes.export")
    assert r.returncode == 0, r.stderr[-2000:]
    entry = json.loads((tmp_path / "run" / "export" / "export.json").read_text())["model.pt2"]
    assert list(entry["inputs"]) == ["audio", "audio_lengths"]
    assert entry["max_abs_error"] <= 1e-5  # recipes.export compared it with the eager model on val batches
    program = torch.export.load(tmp_path / "run" / "export" / "model.pt2").module()
    audio = torch.randn(2, 5000)
    log_probs, frames = program(audio, torch.tensor([5000, 3000]))
    assert log_probs.shape[-1] == 29 and frames.tolist() == [249, 149]  # raw samples in, 20-sample frames


@pytest.mark.slow  # two 2-rank gloo runs (~40 s each on a loaded 2-core host)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_fine_tune_with_layer_drop_and_a_frozen_warm_up(tmp_path: Path, parallel: str) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers import dist_env_vars

    manifest = tone_manifest(tmp_path, 8, ("yes", "no"))
    src = _source("wav2vec2")
    path = save(src, "huggingface", tmp_path)
    sizes = [
        "model.conv_layers=[[16,10,5],[16,3,2],[16,2,2]]",
        *(f"model.{k}={TINY[k]}" for k in ("dim", "layers", "heads", "ff_dim", "pos_conv_kernel")),
        f"model.pos_conv_groups={TINY['pos_conv_groups']}",
    ]
    cmd = [sys.executable, "-m", "recipes.train", "+task=asr", "model=wav2vec2_ctc", *sizes]
    cmd += [f"model.weights={path}", "model.freeze_encoder_steps=2", "model.layer_drop=0.5", "data=manifest"]
    cmd += [f"data.train={manifest}", f"data.val={manifest}", "trainer=smoke", "logger=none"]
    cmd += ["trainer.batch_size=4", "dist.nproc_per_node=2", f"trainer.parallel={parallel}"]
    cmd += ["trainer.progress=false", "trainer.export=last", f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run(cmd, cwd=tmp_path, env=dist_env_vars(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]  # DDP: a step without some parameters' gradients is no error
    trained = load_file(tmp_path / "run" / "model.safetensors")
    for k, v in src.state_dict().items():
        if k.startswith("feature_extractor."):
            assert torch.equal(trained[k], v), k  # frozen throughout, on every rank
    moved = "encoder.feature_projection.projection.weight"
    assert not torch.equal(trained[moved], src.state_dict()[moved])  # trained after the warm-up
