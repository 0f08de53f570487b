"""`python -m recipes.eval`: the loop's validation numbers again, exactly, from a finished run's weights;
other splits and data; one line and exit 2 for a bad argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from core.errors import TorchkilnError
from recipes.eval import main
from tests.helpers import DIGITS, AsrRun, train, val_row


def test_eval_reproduces_the_loops_validation_exactly(digits_run: Path, cli_here, tmp_path: Path) -> None:
    # trainer.export=last: model.safetensors holds the weights the loop evaluated at its last step (5)
    r = cli_here(f"ckpt={digits_run}", module="recipes.eval")
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout)  # one line
    result = json.loads((digits_run / "eval.json").read_text())
    assert result["metrics"] == line["metrics"] == val_row(digits_run, 5)  # ==: same plan, batches, order
    assert {"val/loss", "val/accuracy", "val/accuracy_top5"} <= set(result["metrics"])
    assert (result["split"], result["examples"]) == ("val", 359)  # 20% of each digit class
    # the step's checkpoint folder gives the same weights, so the same numbers; out= puts the file elsewhere
    step = digits_run / "checkpoints" / "step_00000005"
    assert main([f"ckpt={step}", f"out={tmp_path / 'e.json'}"]) == 0
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["metrics"] == result["metrics"] and again["weights"] == str(step)


def test_eval_runs_in_the_precision_auto_trained_in_where_the_model_s_pick_is_not_the_machine_s(
    cli_here, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """precision=auto on a CPU: a run's own model probe may pick the other precision than the machine's
    choice (on an AMX Xeon it did, BENCHMARKS.md § Device precision). Steered to the other one here, the
    exported weights and a checkpoint both evaluate in what the run trained in, to the loop's numbers."""
    from core.device import model_precision as mp
    from core.device import resolve

    machine = resolve("cpu", "auto").precision
    other, (fp32_ms, bf16_ms) = ("fp32", (2.0, 10.0)) if machine == "bf16" else ("bf16", (10.0, 2.0))
    steered = mp.ModelTiming(fp32_ms, bf16_ms, 0.0, "2026-12-05T00:00:00+00:00")
    monkeypatch.setattr(mp, "timing", lambda key, model, step: steered)  # nothing cached
    run = train(tmp_path / "run", DIGITS)
    assert json.loads((run / "result.json").read_text())["precision"] == other
    step = run / "checkpoints" / "step_00000005"
    assert json.loads((step / "meta.json").read_text())["precision"] == other
    for ckpt in (run, step):
        r = cli_here(f"ckpt={ckpt}", f"out={tmp_path / 'e.json'}", module="recipes.eval")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["metrics"] == val_row(run, 5)  # ==: the loop's plan, batches and order


def test_eval_of_an_asr_checkpoint_equals_its_validation_and_reads_the_test_split(
    asr_run: AsrRun, cli_here, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    step = asr_run.run / "checkpoints" / "step_00000005"
    r = cli_here(f"ckpt={step}", module="recipes.eval", env=asr_run.env)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads(r.stdout)["metrics"]
    # the beam_lexicon decoder of the embedded corpus's config, and the greedy rates beside it
    assert metrics == val_row(asr_run.run, 5) and "val/greedy_wer" in metrics
    for k, v in asr_run.env.items():
        monkeypatch.setenv(k, v)
    assert main([f"ckpt={step}", "split=test", f"out={asr_run.run / 'test.json'}"]) == 0
    result = json.loads((asr_run.run / "test.json").read_text())
    assert (result["split"], result["examples"], result["overrides"]) == ("test", 2, ["data.eval_split=test"])
    assert result["metrics"]["val/loss"] != metrics["val/loss"]  # other utterances
    # the same weights decoded another way: greedy's WER is the loop's greedy WER, beside its beam's
    assert main([f"ckpt={step}", "task.decoder=greedy", f"out={asr_run.run / 'greedy.json'}"]) == 0
    greedy = json.loads((asr_run.run / "greedy.json").read_text())
    assert greedy["overrides"] == ["task.decoder=greedy"]
    assert greedy["metrics"]["val/wer"] == metrics["val/greedy_wer"]
    assert greedy["metrics"]["val/loss"] == metrics["val/loss"]
    assert main([f"ckpt={step}", "task.decoder=nonsense"]) == 2  # checked against the task's choices
    capsys.readouterr()


def _tree(root: Path, classes: list[str], per_class: int = 2) -> None:
    """An ImageFolder tree (train/, val/) of 8x8 digit images, pixel values as the digits set holds them."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for j, i in enumerate(np.flatnonzero(d.target == c)[:per_class]):
                Image.fromarray(np.round(d.images[i] * 255 / 16).astype("uint8")).save(folder / f"{j}.png")


def test_data_overrides_evaluate_other_data(
    digits_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the digits model on an image folder of digits: same classes (0..9), shape and normalization
    _tree(tmp_path / "tree", [str(c) for c in range(10)])
    data = ["data.name=imagefolder", f"data.root={tmp_path / 'tree'}", "data.image_size=8", "data.channels=1"]
    assert main([f"ckpt={digits_run}", *data, f"out={tmp_path / 'e.json'}"]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["examples"] == 20 and result["overrides"] == data
    assert 0 <= result["metrics"]["val/accuracy"] <= 1
    # a folder whose classes are not the model's is refused in one line
    _tree(tmp_path / "other", ["cat", "dog"])
    assert main([f"ckpt={digits_run}", *data[:1], f"data.root={tmp_path / 'other'}", *data[2:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "classes [cat, dog] (2)" in err and "[0, 1, 2, 3, 4, ...] (10)" in err
    # another split of the same data: a data key
    assert main([f"ckpt={digits_run}", "data.val_fraction=0.5", f"out={tmp_path / 'half.json'}"]) == 0
    assert json.loads((tmp_path / "half.json").read_text())["examples"] > 800  # half of 1,797, not 20%


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["split=test"], "split=test: data=digits has no such split; its held-out splits: val"),
        (["data.bogus=1"], "unknown config key 'data.bogus'; valid keys: augment,"),
        (["data.val_fraction=2"], "data.val_fraction=2.0 is out of range; valid: > 0 and < 1"),
        (
            ["splitt=val"],
            "unknown key 'splitt'; valid keys: ckpt, split, out, device, precision, harness.tasks, "
            "harness.include, harness.limit, harness.num_fewshot, harness.apply_chat_template, "
            "harness.batch_size, data.KEY",
        ),
        (["task.bogus=1"], "unknown config key 'task.bogus'"),
        (["split"], "argument 'split' is not key=value"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(
    digits_run: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([f"ckpt={digits_run}", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_no_run_there_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"ckpt={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no .hydra/config.yaml" in err
    assert main(["--help"]) == 0 and "split" in capsys.readouterr().out


def test_eval_of_a_speech_run_writes_each_utterance_and_its_errors_sum_to_the_rates(
    asr_run: AsrRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from audio.scoring import english_normalizer
    from audio.transcripts import normalize_transcript

    for k, v in asr_run.env.items():
        monkeypatch.setenv(k, v)
    step = asr_run.run / "checkpoints" / "step_00000005"
    assert main([f"ckpt={step}", f"out={tmp_path / 'e.json'}"]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    metrics, summary = result["metrics"], result["utterances"]
    file = tmp_path / "e_utterances.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    assert summary["file"] == str(file) and len(rows) == result["examples"] == 2
    # each row is its clip's: the manifest's transcript for that audio file, as the task normalises it
    manifest = [json.loads(line) for line in (asr_run.corpus / "val.jsonl").read_text().splitlines()]
    texts = {(asr_run.corpus / m["audio_filepath"]).resolve(): m["text"] for m in manifest}
    assert sorted(r["index"] for r in rows) == [0, 1]
    assert all(r["reference"] == normalize_transcript(texts[Path(r["path"]).resolve()]) for r in rows)
    # the file's counts sum to the totals reported, which the rates divide (pooled, not a mean of rates)
    totals = {k: v for k, v in summary.items() if k != "file"}
    assert {k: sum(r[k] for r in rows) for k in totals} == totals
    assert metrics["val/wer"] == totals["word_errors"] / totals["words"]
    assert metrics["val/cer"] == totals["char_errors"] / totals["chars"]
    normalize = english_normalizer()
    if normalize is not None:
        assert metrics["val/wer_normalized"] == totals["word_errors_normalized"] / totals["words_normalized"]
        assert metrics["val/cer_normalized"] == totals["char_errors_normalized"] / totals["chars_normalized"]
        assert all(r["hypothesis_normalized"] == normalize(r["hypothesis"]) for r in rows)
    # the loop's validation reported the same rates, the normalised ones included
    assert metrics == val_row(asr_run.run, 5)


def _harness_case(case: str, tmp_path: Path) -> tuple[list[str], tuple[str, str]]:
    """(the harness arguments of a bad-input case, the (key, value) its error names)."""
    from bench.harness import write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    given = [f"harness.include=[{tasks}]"]
    if case == "limit":
        return [*given, "harness.tasks=[tiny_mc]", "harness.limit=0"], ("harness.limit", "0.0")
    if case == "unknown":
        return [*given, "harness.tasks=[tiny_nope]"], ("harness.tasks", "tiny_nope")
    if case == "yaml":
        (tasks / "broken.yaml").write_text("task: [unclosed\n")
        return [*given, "harness.tasks=[tiny_mc]"], ("harness.include", str(tasks / "broken.yaml"))
    if case == "missing":
        (tasks / "mc.jsonl").unlink()
        return [*given, "harness.tasks=[tiny_all]"], (
            "harness.tasks.dataset_kwargs.data_files",
            str(tasks / "mc.jsonl"),
        )
    # a task that would download its data from the Hub
    text = (tasks / "tiny_mc.yaml").read_text().replace("dataset_path: json", "dataset_path: super_glue")
    (tasks / "tiny_mc.yaml").write_text(text)
    return [*given, "harness.tasks=[tiny_mc]"], ("harness.tasks.dataset_path", "super_glue")


@pytest.mark.parametrize("case", ["limit", "unknown", "yaml", "missing", "download"])
def test_harness_bad_input_is_one_line_exit_2_before_any_work(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lm_eval")
    from recipes.eval import run
    from tests.helpers import fault

    args, (key, value) = _harness_case(case, tmp_path)
    argv = ["ckpt=/no/such/run", *args, f"out={tmp_path / 'out'}"]  # refused before the run is read
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(TorchkilnError) as e:
        run(argv)
    assert fault(e.value)[:2] == (key, value)
    assert not (tmp_path / "out").exists()


def test_harness_without_the_eval_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.eval import run
    from tests.helpers import fault

    for name in ["lm_eval", *(m for m in sys.modules if m.startswith("lm_eval."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing any of lm_eval raises ImportError
    monkeypatch.delitem(sys.modules, "text.harness", raising=False)  # imported afresh
    with pytest.raises(TorchkilnError) as e:
        run(["ckpt=/no/such/run", "harness.tasks=[tiny_mc]"])
    assert fault(e.value) == ("harness", "lm_eval", ("pip install torchkiln[eval]",))
    assert main(["ckpt=/no/such/run", "harness.tasks=[tiny_mc]"]) == 2
