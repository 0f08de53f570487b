"""`python -m recipes.predict` and its faces (recipes.transcribe, recipes.generate): a finished run's
predictions for new inputs, checked against the model run in-process and the task's own metric code; a bad
key or input is one line and exit 2."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from audio.ctc import edit_counts, error_rates, normalize_transcript
from audio.datasets import read_audio
from core.errors import DataError
from core.registry import TASKS
from recipes.cli.runs import load_run
from recipes.predict import main
from recipes.transcribe import main as transcribe_main
from tests.helpers import AsrRun, fault, write_table
from vision.datasets import eval_transform, read_image


def _digit_pngs(folder: Path, n: int = 6) -> tuple[list[Path], torch.Tensor]:
    """`n` digits validation images saved as 8-bit PNGs (ink bright on dark, as the set holds them), half of
    them in a subfolder; their paths (sorted) and the dataset's own tensors of them."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    paths = []
    for i in range(n):
        path = folder / ("deeper" if i % 2 else "") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round(d.images[1000 + i] * 255 / 16).astype("uint8")).save(path)
        paths.append(path)
    order = sorted(range(n), key=lambda i: paths[i])
    images = torch.tensor(d.images[1000 : 1000 + n], dtype=torch.float32)[order]
    return [paths[i] for i in order], (images / 16 - 0.5) / 0.5  # the digits dataset's normalization


def test_predict_on_image_files_gives_the_models_classes_and_probabilities(
    digits_run: Path, cli_here, tmp_path: Path
) -> None:
    files, dataset_x = _digit_pngs(tmp_path / "images")
    out = tmp_path / "p.csv"
    args = [f"ckpt={digits_run}", f"input={tmp_path / 'images'}", f"out={out}", "top_k=10"]
    r = cli_here(*args, module="recipes.predict")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == {"predictions": str(out), "rows": 6}
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["path"] for row in rows] == [str(p) for p in files]
    # the model in-process, on the same batch under the run's device plan (its autocast)
    run = load_run(digits_run)
    x = torch.stack([read_image(p, eval_transform(1, 8)) for p in files])
    assert (x[:, 0] - dataset_x).abs().max() < 2 * 2 / 255  # a saved digit reads back to 8-bit rounding
    with torch.no_grad(), run.plan.autocast():
        probs = run.model(x).float().softmax(-1)
    for row, p in zip(rows, probs, strict=True):
        ranked = [(row["class"], float(row["prob"]))]
        ranked += [(row[f"class_{k}"], float(row[f"prob_{k}"])) for k in range(2, 11)]
        assert sorted(c for c, _ in ranked) == [str(c) for c in range(10)]  # named as in training
        # the top class is the model's argmax (bf16 logits tie often: then any of the tied classes)
        assert float(p[int(ranked[0][0])]) == float(p.max())
        assert sum(q for _, q in ranked) == pytest.approx(1.0, abs=1e-5)
        assert [q for _, q in ranked] == pytest.approx([float(p[int(c)]) for c, _ in ranked], abs=1e-6)


def test_predict_on_a_manifest_scores_the_transcripts_as_the_task_does(
    asr_run: AsrRun, cli_here, tmp_path: Path
) -> None:
    manifest, out = asr_run.corpus / "val.jsonl", tmp_path / "t.jsonl"
    # a large word score makes the 5-step model's lexicon beam search emit words: scores that are not 1.0
    args = [f"ckpt={asr_run.run}", f"input={manifest}", f"out={out}", "task.word_score=10"]
    r = cli_here(*args, module="recipes.predict", env=asr_run.env)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    refs = [normalize_transcript(json.loads(x)["text"]) for x in manifest.read_text().splitlines()]
    assert [row["reference"] for row in rows] == refs
    hyps = [row["text"] for row in rows]
    assert any(hyps)
    assert {k: summary[k] for k in ("wer", "cer")} == error_rates(edit_counts(refs, hyps))
    assert (summary["rows"], summary["scored"]) == (2, 2)


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_transcribe_takes_a_folder_and_honours_the_decoder(
    asr_run: AsrRun, cli_here, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = asr_run.corpus / "wav" / "val"
    args = [f"ckpt={asr_run.run}", f"audio={folder}", "decoder=greedy"]
    r = cli_here(*args, module="recipes.transcribe", env=asr_run.env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    wavs = sorted(folder.glob("*.wav"))
    assert [row["path"] for row in rows] == [str(p) for p in wavs]
    run = load_run(asr_run.run, overrides=["task.decoder=greedy"])
    with torch.no_grad():
        greedy = run.task.transcribe_batch(run.model, [read_audio(p, run.task.sample_rate) for p in wavs])
    assert [row["text"] for row in rows] == greedy
    # decoder= changes what is decoded: the run's lexicon beam search (words, with a large word score) and
    # greedy decoding of the same model differ
    one = [f"ckpt={asr_run.run}", f"audio={wavs[0]}", "task.word_score=10"]
    assert transcribe_main(one) == 0
    beam = capsys.readouterr().out
    assert transcribe_main([*one, "decoder=greedy"]) == 0
    assert capsys.readouterr().out == greedy[0] + "\n" != beam
    assert transcribe_main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage:")
    assert transcribe_main([f"ckpt={asr_run.run}", f"audio={wavs[0]}", "decoder=viterbi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decoder=viterbi is unknown; valid: greedy, lexicon" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["input=missing"], "error: missing does not exist; give an image file or a folder of images"),
        (["input=BAD"], "bad.png: cannot read as an image"),
        (["input=GOOD", "top_k=0"], "top_k=0 is out of range; valid: >= 1"),
        (
            ["input=GOOD", "topk=3"],
            "unknown key 'topk'; valid keys: ckpt, input, out, batch_size, device, top_k, task.KEY",
        ),
        (["input=GOOD", "max_new_tokens=3"], "unknown key 'max_new_tokens'"),  # an lm run's option
        (["input=GOOD", "out=p.txt"], "out=p.txt: give a .csv or .jsonl file"),
        (["input=GOOD", "task.bogus=1"], "unknown config key 'task.bogus'; valid keys: "),
        (["out=p.csv"], "input= is required"),
    ],
)
def test_a_bad_key_or_input_is_one_line_and_exit_2(
    digits_run: Path, tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _digit_pngs(tmp_path / "good", 1)
    _digit_pngs(tmp_path / "bad", 1)
    (tmp_path / "bad" / "bad.png").write_bytes(b"not a png")
    args = [a.replace("BAD", str(tmp_path / "bad")).replace("GOOD", str(tmp_path / "good")) for a in args]
    assert main([f"ckpt={digits_run}", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_text_classification_predicts_labels_of_table_rows_and_text_files(tmp_path: Path) -> None:
    write_table(tmp_path / "train.jsonl", 4)
    table = str(tmp_path / "train.jsonl")
    data = {"name": "text_table", "train": table, "val": table}
    model = {"name": "text_encoder", "n_layer": 1, "d_model": 32, "n_head": 2}  # tests/text's tiny sizes
    task = TASKS.build("text_classification", model=model, data=data, tokenizer="bytes", max_len=32)
    net = task.build_model().eval()
    (tmp_path / "in.csv").write_text('id,text\n1,sing and praise\n2,"statute, ordinance"\n')
    items = task.prediction_inputs(tmp_path / "in.csv")
    with torch.no_grad():
        rows = task.predict(net, items, top_k=2)
    assert [r["id"] for r in rows] == [f"{tmp_path / 'in.csv'}:2", f"{tmp_path / 'in.csv'}:3"]
    assert all({r["class"], r["class_2"]} == {"law", "song"} for r in rows)
    assert all(r["prob"] + r["prob_2"] == pytest.approx(1.0, abs=1e-6) for r in rows)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("sing\n")
    assert [i for i, _ in task.prediction_inputs(tmp_path / "texts")] == [str(tmp_path / "texts" / "a.txt")]
    (tmp_path / "no_text.csv").write_text("id,body\n1,x\n")
    with pytest.raises(DataError) as e:
        task.prediction_inputs(tmp_path / "no_text.csv")
    assert fault(e.value) == ("columns", "id,body", ("text",))


def test_lm_predicts_a_continuation_per_prompt_line(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("In the beginning God created the heaven and the earth.\n" * 9)
    model = {"name": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2}  # tests/text's tiny sizes
    data = {"name": "text_files", "root": str(tmp_path / "corpus")}
    task = TASKS.build("lm", model=model, data=data, context=32)
    net = task.build_model().eval()
    (tmp_path / "prompts.txt").write_text("In the\n\nAnd God\n")
    prompts = task.prediction_inputs(tmp_path / "prompts.txt")
    with torch.no_grad():
        rows = task.predict(net, prompts, max_new_tokens=5, seed=1)
        again = task.predict(net, prompts, max_new_tokens=5, seed=1)
    assert [r["prompt"] for r in rows] == ["In the", "", "And God"]
    assert rows == again and all(r["text"].startswith(r["prompt"]) for r in rows)
    with pytest.raises(DataError) as e:
        task.prediction_inputs(tmp_path / "corpus")
    assert fault(e.value)[:2] == ("input", str(tmp_path / "corpus"))
