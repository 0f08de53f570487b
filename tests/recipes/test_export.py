"""`python -m recipes.export`: tiny runs of each task exported through the CLI, loaded back here and compared
with the eager model on the run's validation data; the one-line refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from audio import corpus
from core.errors import ExportError
from core.loop.task import ExportInputs, batch_dim
from recipes import export as ex
from recipes.cli.runs import load_run
from tests.helpers import TINY_CLS, TINY_LM, fault, in_process, write_table
from tests.helpers import train as train_here

# fp32 on the CPU; recipes.export says why these suffice. torch_export replays the same ATen ops: exact here.
RTOL, ATOL = 1e-4, 1e-5
SPEECH = {"train": 8, "val": 2, "test": 2}
ASR_MODEL = ["model.dim=64", "model.layers=2", "model.heads=2", "model.subsampling_channels=16"]


def train(root: Path, *overrides: str, env: dict[str, str] | None = None) -> Path:
    """A trainer=smoke run of `overrides` (recipes.train in this process), without a logger (export reads the
    checkpoint, and the arm64 venv has no tensorboard); its run directory."""
    run = root / "run"
    return train_here(
        run, ["trainer=smoke", "logger=none", *overrides], {"OMP_NUM_THREADS": "1", **(env or {})}
    )


@pytest.fixture(scope="module")
def speech_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the tiny generated speech corpus the ASR run reads (and export reads again)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHKILN_CACHE", str(root))
        corpus.ensure_corpus(0, SPEECH, progress=False)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """The tiny run of a task, trained on first use (module-scoped: each task trains once, only if asked)."""
    made: dict[str, Path] = {}

    def make(task: str) -> Path:
        if task in made:
            return made[task]
        root = tmp_path_factory.mktemp(task)
        if task == "image_classification":
            # 2 steps, one validation batch, fp32 (no precision=auto model probe): what is checked is the
            # export, not the training
            tiny = ["model.width=16", "precision=fp32", "trainer.max_steps=2", "trainer.limit_val_batches=1"]
            made[task] = train(root, "+task=image_classification", *tiny)
        elif task == "lm":
            made[task] = train(root, "+task=lm", "trainer.max_steps=2", "trainer.batch_size=4", *TINY_LM)
        elif task == "text_classification":
            # texts of several lengths, so the two checked batches differ in length as well as size
            write_table(root / "train.jsonl", 12)
            lines = [json.dumps({"text": " ".join(["sing"] * n), "label": "song"}) for n in (2, 5, 3, 7)]
            (root / "val.jsonl").write_text("\n".join(lines) + "\n")
            data = ["data=text_table", f"data.train={root}/train.jsonl", f"data.val={root}/val.jsonl"]
            made[task] = train(root, "+task=text_classification", *data, "task.bpe_vocab_size=300", *TINY_CLS)
        else:  # asr, or asr_joint: an attention decoder beside the CTC head
            sizes = [f"data.{s}_size={n}" for s, n in SPEECH.items()]
            env = {"TORCHKILN_CACHE": str(request.getfixturevalue("speech_cache"))}
            joint = ["model.attention_decoder_layers=1"] if task == "asr_joint" else []
            made[task] = train(root, "experiment=asr_conformer", *sizes, *ASR_MODEL, *joint, env=env)
        return made[task]

    return make


def eager_cases(run_dir: Path) -> list[tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]]:
    """Two validation batches (several items, then one shorter item) as the exported model's named inputs,
    with the eager model's outputs, written out per task here rather than through `Task.export_inputs`."""
    run = load_run(run_dir)
    task, model = run.task, run.model
    _, val = task.build_datasets()
    collate = task.collate_fn() or default_collate
    cases = []
    for items, cut in (([val[i] for i in range(min(3, len(val)))], None), ([val[len(val) - 1]], 5)):
        batch = collate(items)
        with torch.no_grad():
            if run.cfg["task"]["name"] == "image_classification":
                feed = {"images": batch[0]}
                out = (model(batch[0]),)
            elif run.cfg["task"]["name"] == "lm":
                feed = {"tokens": batch[0][:, :cut]}
                out = (model(feed["tokens"]),)
            elif run.cfg["task"]["name"] == "text_classification":
                feed = {"tokens": batch["tokens"][:, :cut], "mask": batch["mask"][:, :cut]}
                out = (model(feed["tokens"], feed["mask"]),)
            else:  # asr: the export takes waveforms; the eager path is evaluation's features, then the model
                samples = None if cut is None else 4000  # 0.25 s of the last clip
                feed = {"audio": batch["audio"][:, :samples], "audio_lengths": batch["audio_lengths"]}
                if samples is not None:
                    feed["audio_lengths"] = feed["audio_lengths"].clamp(max=samples)
                feats = task.on_device(model.eval(), dict(feed))
                out = model(feats["features"], feats["feature_lengths"])
        cases.append((feed, out))
    return cases


def load_back(fmt: str, path: Path, names: list[str]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The exported file as a function of its named inputs."""
    if fmt == "torch_export":
        module = torch.export.load(path).module()
        return lambda feed: _tuple(module(*feed.values()))
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == names
    return lambda feed: tuple(
        torch.from_numpy(o) for o in session.run(None, {k: v.contiguous().numpy() for k, v in feed.items()})
    )


def _tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# Each export is seconds of tracing (minutes under emulation): the default run keeps ONNX (which
# exports through torch.export's graph) for image classification; torch.export alone, the LM, text
# classification and ASR (a generated speech corpus, the largest graph) export in the slow run.
CASES = [
    pytest.param("image_classification", "torch_export", marks=[pytest.mark.slow, pytest.mark.arm64]),
    ("image_classification", "onnx"),
    pytest.param("lm", "torch_export", marks=pytest.mark.slow),
    pytest.param("lm", "onnx", marks=pytest.mark.slow),
    pytest.param("text_classification", "torch_export", marks=pytest.mark.slow),
    pytest.param("text_classification", "onnx", marks=pytest.mark.slow),
    pytest.param("asr", "torch_export", marks=pytest.mark.slow),
    pytest.param("asr", "onnx", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("task", "fmt"), CASES)
def test_export_loads_back_and_matches_the_eager_model(
    runs: Callable[[str], Path],
    task: str,
    fmt: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    run = runs(task)
    cache = str(request.getfixturevalue("speech_cache")) if task == "asr" else str(tmp_path / "cache")
    capsys.readouterr()  # the training run's output, when this test trained it
    out = tmp_path / ("model.pt2" if fmt == "torch_export" else "model.onnx")
    # recipes.export in this process: what is checked is the file it writes, not the process
    env = {"OMP_NUM_THREADS": "1", "TORCHKILN_CACHE": cache}
    code = in_process(ex.main, [f"ckpt={run}", f"format={fmt}", f"out={out}"], env=env, cwd=tmp_path)
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    assert stdout.count("\n") == 1 and stdout.startswith(f"exported {out} ({fmt})")
    entry = json.loads((tmp_path / "export.json").read_text())[out.name]
    checked = entry["checked"]
    # the command's own check: two batches of different sizes (and lengths, where there is a length dim)
    first, second = (list(c["inputs"].values())[0] for c in checked)
    assert first[0] > second[0] and (task == "image_classification" or first[1] > second[1]), checked
    assert entry["max_abs_error"] <= ATOL + RTOL and (fmt == "onnx" or entry["max_abs_error"] == 0)

    cases = eager_cases(run)
    program = load_back(fmt, out, list(cases[0][0]))
    for feed, expected in cases:
        got = program(feed)
        assert len(got) == len(expected)
        for a, b in zip(expected, got, strict=True):
            if a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
            else:
                assert torch.equal(b.to(a.dtype), a)


@pytest.mark.slow  # an ASR run and two exports of two programs each (~2 min on two cores)
@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_a_joint_asr_model_exports_its_decoder_beside_the_encoder(
    runs: Callable[[str], Path],
    fmt: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    run = runs("asr_joint")
    suffix = ".pt2" if fmt == "torch_export" else ".onnx"
    out = tmp_path / f"model{suffix}"
    env = {"OMP_NUM_THREADS": "1", "TORCHKILN_CACHE": str(request.getfixturevalue("speech_cache"))}
    code = in_process(ex.main, [f"ckpt={run}", f"format={fmt}", f"out={out}"], env=env, cwd=tmp_path)
    assert code == 0, capsys.readouterr().err[-3000:]
    entries = json.loads((tmp_path / "export.json").read_text())
    decoder_file = tmp_path / f"model.decoder{suffix}"
    assert entries[out.name]["parts"] == {"decoder": decoder_file.name}
    assert entries[out.name]["outputs"] == ["log_probs", "frames", "encoder_out"]
    assert list(entries[decoder_file.name]["inputs"]) == ["tokens", "encoder_out", "frames"]
    assert all(entries[f]["max_abs_error"] <= ATOL + RTOL for f in (out.name, decoder_file.name))
    # greedy attention decoding of a validation clip with the two exported programs, token by token,
    # against the eager model's decoder on its own encoder output
    loaded = load_run(run)
    model = loaded.model.eval()
    feed, (log_probs, _) = eager_cases(run)[0]
    encoder = load_back(fmt, out, list(feed))
    decoder = load_back(fmt, decoder_file, ["tokens", "encoder_out", "frames"])
    got_log_probs, frames, encoder_out = encoder(feed)
    torch.testing.assert_close(got_log_probs, log_probs, rtol=RTOL, atol=ATOL)
    tokens = torch.zeros(frames.shape[0], 1, dtype=torch.int64)  # <sos>: the CTC blank's id
    for _ in range(3):
        step_feed = {"tokens": tokens, "encoder_out": encoder_out, "frames": frames}
        (logits,) = decoder(step_feed)
        with torch.no_grad():
            want = model.attention_decoder(tokens, encoder_out, frames.to(torch.int64))
        torch.testing.assert_close(logits, want, rtol=RTOL, atol=ATOL)
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], 1)


@pytest.mark.arm64
def test_safetensors_holds_the_trained_weights(runs: Callable[[str], Path], capsys) -> None:
    from safetensors.torch import load_file

    run = runs("image_classification")
    assert ex.main([f"ckpt={run}", "format=safetensors"]) == 0, capsys.readouterr().err
    weights = load_file(run / "export" / "model.safetensors")
    trained = load_run(run).model.state_dict()
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in weights)
    assert json.loads((run / "export" / "export.json").read_text())["model.safetensors"]["max_abs_error"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ckpt=RUN", "format=zip"], "format=zip is unknown; valid: safetensors, torch_export, onnx, hf"),
        (["ckpt=RUN", "format=onnx", "opset=18"], "unknown key 'opset'; valid keys: ckpt, format, out"),
        (["format=onnx"], "ckpt= and format= are required"),
        (["ckpt=RUN", "format=torch_export", "out=model.onnx"], "a format=torch_export file ends in .pt2"),
        (["ckpt=NOT_A_RUN", "format=torch_export"], "no .hydra/config.yaml there"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("NOT_A_RUN", str(tmp_path)).replace("RUN", str(tmp_path)) for a in argv]
    assert ex.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_missing_onnx_packages_name_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = ex.importlib.util.find_spec
    missing = lambda name, *a: None if name == "onnxruntime" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(ex.importlib.util, "find_spec", missing)
    assert ex.main([f"ckpt={tmp_path}", "format=onnx"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs onnxruntime: pip install 'torchkiln[export]'" in err


def test_a_model_that_cannot_export_is_refused_in_one_line(
    runs: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the LM's packed-documents path (doc_ids) finds document starts from the data: no graph can hold that
    from text.lm import LanguageModeling

    real = LanguageModeling.export_inputs

    def with_doc_ids(self: Any, model: nn.Module, batch: Any, *, length: int | None = None) -> ExportInputs:
        plain = real(self, model, batch, length=length)
        doc_ids = batch[2][:, : plain.length]
        return ExportInputs(
            model,
            (*plain.args, doc_ids),
            ("tokens", "doc_ids"),
            plain.outputs,
            (plain.dynamic_shapes[0], plain.dynamic_shapes[0]),
            plain.preprocessing,
            plain.length,
        )

    monkeypatch.setattr(LanguageModeling, "export_inputs", with_doc_ids)
    out = tmp_path / "model.pt2"
    assert ex.main([f"ckpt={runs('lm')}", "format=torch_export", f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: model=gpt (lm) cannot be exported as torch_export")
    assert "control flow depends on tensor values" in err and "in pack_documents" in err, err
    assert not out.exists()


def test_an_op_onnx_lacks_is_named() -> None:
    pytest.importorskip("onnxruntime")

    class Eigenvalues(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.eigvalsh(x @ x.mT)

    x = torch.randn(2, 3, 3)
    inputs = ExportInputs(Eigenvalues().eval(), (x,), ("x",), ("values",), ({0: batch_dim()},), "")
    with pytest.raises(ExportError) as e:
        ex.write_onnx(None, inputs, Path("unused.onnx"))  # type: ignore[arg-type]
    assert fault(e.value) == ("op", "aten._linalg_eigh.default", ())


def test_differences_past_the_tolerance_are_refused() -> None:
    a, n = torch.tensor([1.0, 100.0]), torch.tensor([3])
    within = a + torch.tensor([1e-6, 1e-3])  # 1e-3 of 100 is inside rtol=1e-4 * 100
    assert ex.compare((a, n), (within, n), ["x", "n"]) == pytest.approx(1e-3, rel=1e-2)
    with pytest.raises(ExportError) as e:
        ex.compare(a, a + 0.02, ["x"])
    assert fault(e.value)[:2] == ("output", "x") and "0.02" in str(e.value)  # the measured difference
    # the bound is the output's scale: an element near 0 among logits of tens may err as much as they do
    logits = torch.tensor([0.0, -20.0, 3.0])
    assert ex.compare(logits, logits + torch.tensor([5e-5, 0.0, 0.0]), ["logits"]) == pytest.approx(5e-5)
    assert ex.tolerance(logits) == pytest.approx(1e-5 + 1e-4 * 20)
    with pytest.raises(ExportError) as e:  # 2.1e-3 past 1e-5 + 1e-4 x 20
        ex.compare(logits, logits + torch.tensor([0.0, 0.0, 2.1e-3]), ["logits"])
    assert fault(e.value)[:2] == ("output", "logits")
    small = torch.tensor([1e-3, -2e-3])  # all near 0: atol decides
    with pytest.raises(ExportError):
        ex.compare(small, small + 3e-5, ["x"])
    with pytest.raises(ExportError):  # a NaN is never within any bound
        ex.compare(logits, logits + torch.tensor([float("nan"), 0.0, 0.0]), ["logits"])
    # a masked logit: the same infinity is a match and sets no scale; any other value is refused
    masked = torch.tensor([float("-inf"), 2.0, -1.0])
    assert ex.tolerance(masked) == pytest.approx(1e-5 + 1e-4 * 2)
    assert ex.compare(masked, masked + torch.tensor([0.0, 1e-4, 0.0]), ["logits"]) == pytest.approx(
        1e-4, rel=1e-2
    )
    for other in (-1e9, float("inf"), float("nan")):
        with pytest.raises(ExportError):
            ex.compare(masked, torch.tensor([other, 2.0, -1.0]), ["logits"])
    with pytest.raises(ExportError):  # a finite output the export makes infinite
        ex.compare(logits, torch.tensor([float("-inf"), -20.0, 3.0]), ["logits"])
    with pytest.raises(ExportError) as e:
        ex.compare(torch.tensor([3]), torch.tensor([4]), ["n"])
    assert fault(e.value) == ("output", "n", ("equal integers",))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["torch_export", "safetensors"])
def test_a_run_trained_on_cuda_exports_and_matches_its_weights(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # trained on the GPU, exported from CPU (recipes.export loads runs there): the command's own check
    # compares the file with the eager model on two validation batches
    run = train(tmp_path, "+task=image_classification", "model.width=16", "device=cuda")
    out = tmp_path / ("model.pt2" if fmt == "torch_export" else "model.safetensors")
    assert ex.main([f"ckpt={run}", f"format={fmt}", f"out={out}"]) == 0, capsys.readouterr().err
    entry = json.loads((tmp_path / "export.json").read_text())[out.name]
    assert entry["max_abs_error"] == 0
    model = load_run(run, device="cpu").model
    if fmt == "torch_export":
        shape = list(entry["checked"][0]["inputs"].values())[0]
        images = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = model(images)
        got = load_back(fmt, out, ["images"])({"images": images})[0]
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    else:
        from safetensors.torch import load_file

        weights, trained = load_file(out), model.state_dict()
        assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in weights)
