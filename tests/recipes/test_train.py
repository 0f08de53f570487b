"""`python -m recipes.train` end to end: training, outputs, resume, sweeps, ImageFolder, presets, installed
package."""

from __future__ import annotations

import csv
import json
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recipes.cli.curves import PANEL_PX
from recipes.train import main
from tests.helpers import REPO, artifact_kernels, cli_env, kernel_files, read_metrics, train

TINY = ["+task=image_classification", "trainer.progress=false", "model.width=16"]


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real CLI run in a subprocess: 2 epochs on digits, every checkpoint kept (conftest's digits_run is
    5 steps)."""
    # fp32 pinned: the preempted run is compared with it bit for bit, and two runs' precision=auto may differ
    # (a model probe under the suite's load decides nothing; a quiet one may pick the other precision)
    args = [*TINY, "trainer.max_epochs=2", "trainer.keep_last=5", "precision=fp32"]
    return train(tmp_path_factory.mktemp("digits") / "run", args)


def test_cli_trains_digits_and_writes_outputs(two_epoch_run: Path) -> None:
    result = json.loads((two_epoch_run / "result.json").read_text())
    assert result["metrics"]["val/accuracy"] > 0.5  # 2 epochs of a small CNN: ~0.9 in practice
    assert result["metrics"]["step"] == 46.0  # 1,438 training images / 64 per batch = 23 steps per epoch
    assert sorted(p.name for p in (two_epoch_run / "checkpoints").iterdir()) == [
        "step_00000023",
        "step_00000046",
    ]
    rows = read_metrics(two_epoch_run)
    assert [r["step"] for r in rows if "val/accuracy" in r] == [23, 46]
    assert list((two_epoch_run / "tb").glob("events.out.tfevents.*"))
    weights = load_file(two_epoch_run / "model.safetensors")
    final = torch.load(two_epoch_run / "checkpoints" / "step_00000046" / "model.pt", weights_only=True)
    assert weights.keys() == final.keys() and len(weights) > 10  # the final weights, under their own names
    assert all(torch.equal(weights[k], final[k]) for k in final)
    from PIL import Image

    # loss, val/accuracy, the other val/* (top-5) and lr panels, 2 x 2
    with Image.open(two_epoch_run / "curves.png") as img:
        assert img.format == "PNG" and img.size == (2 * PANEL_PX[0], 2 * PANEL_PX[1])
        assert len(img.getcolors(1 << 16)) > 3  # axes, text and curves were drawn, not a blank canvas


def test_resume_after_one_epoch_gives_identical_weights(
    two_epoch_run: Path, tmp_path: Path, monkeypatch
) -> None:
    # the second run was interrupted after epoch 1: only that checkpoint is on disk
    run = tmp_path / "resumed"
    shutil.copytree(two_epoch_run / "checkpoints" / "step_00000023", run / "checkpoints" / "step_00000023")
    shutil.copy(two_epoch_run / "metrics.jsonl", run / "metrics.jsonl")
    monkeypatch.chdir(tmp_path)
    main([*TINY, "trainer.max_epochs=2", "resume=auto", f"hydra.run.dir={run}"])
    a, b = load_file(two_epoch_run / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_multirun_writes_sweep_summary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main(["-m", *TINY, "optim.lr=1e-3,3e-3", "trainer.max_steps=3", f"hydra.sweep.dir={tmp_path}/sweep"])
    with (tmp_path / "sweep" / "sweep_summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert "optim.lr=0.001" in rows[0]["overrides"] and "optim.lr=0.003" in rows[1]["overrides"]
    assert all(float(r["wall_s"]) > 0 and 0 <= float(r["val/accuracy"]) <= 1 for r in rows)


def test_imagefolder_tree(tmp_path: Path, monkeypatch) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    for split, start in (("train", 0), ("val", 600)):
        for i in range(start, start + 60):
            if d.target[i] < 3:
                folder = tmp_path / "tree" / split / f"digit{d.target[i]}"
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray((d.images[i] * 15).astype("uint8")).resize((16, 16)).save(folder / f"{i}.png")
    monkeypatch.chdir(tmp_path)
    main(
        [
            *TINY,
            "data=imagefolder",
            f"data.root={tmp_path}/tree",
            "data.image_size=16",
            "data.channels=1",
            "trainer.max_steps=4",
            "trainer.batch_size=8",
            f"hydra.run.dir={tmp_path}/run",
        ]
    )
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["metrics"]["step"] == 4.0 and 0 <= result["metrics"]["val/accuracy"] <= 1
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert weights["0.weight"].shape == (16, 1, 3, 3) and weights["16.weight"].shape == (
        3,
        32,
    )  # 1 ch, 3 classes


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_a_preset_trains_end_to_end(tmp_path: Path, cli_here) -> None:
    # the cheapest preset: ResNet-18 on a 64 px ImageFolder tree of 8 images per split
    from PIL import Image

    for split in ("train", "val"):
        for k, c in enumerate(("a", "b")):
            folder = tmp_path / "tree" / split / c
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (80, 72), (200 * k, 40 * i, 10)).save(folder / f"{i}.png")
    r = cli_here(
        "experiment=imagefolder_resnet18",
        "trainer=smoke",
        "trainer.max_steps=2",
        "trainer.batch_size=4",
        f"data.root={tmp_path / 'tree'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["metrics"]["step"] == 2.0 and 0 <= result["metrics"]["val/accuracy"] <= 1
    # at 64 px small_input=auto kept the ImageNet stem: a 7x7 first convolution
    assert load_file(tmp_path / "run" / "model.safetensors")["conv1.weight"].shape == (64, 3, 7, 7)


def test_installed_package_finds_its_configs(tmp_path: Path) -> None:
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (target / "conf" / "task" / "image_classification.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import recipes, sys; print(recipes.__file__); sys.argv[1:] = "
            "['+task=image_classification', '--cfg', 'job']; from recipes.train import main; main()",
        ],
        cwd=elsewhere,
        env=cli_env({"PYTHONPATH": str(target)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(str(target / "recipes"))
    assert "name: image_classification" in r.stdout and "name: small_cnn" in r.stdout


@pytest.mark.slow
def test_a_compiled_run_resumed_in_a_fresh_cache_dir_starts_warm(tmp_path: Path, cli) -> None:
    """The checkpoint's compile artifacts (torch's plus the C++ kernels) warm another node's empty cache."""
    run = tmp_path / "run"

    def fit(cache: str, steps: int, *extra: str) -> dict[str, float]:
        r = cli(
            *TINY,
            "compile.policy=full",
            f"compile.cache_dir={cache}",
            f"trainer.max_steps={steps}",
            f"hydra.run.dir={run}",
            *extra,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        rows = read_metrics(run)
        return [row for row in rows if "compile/seconds" in row][-1]

    cold = fit(str(tmp_path / "cache_a"), 30)  # epoch 2's eval-mode graph is compiled before step 30
    assert cold["compile/cache_misses"] >= 1 and cold["compile/cache_hits"] == 0
    # the compiled model's checkpoint holds the model's own keys, not the compile wrapper's
    saved = torch.load(run / "checkpoints" / "step_00000030" / "model.pt", weights_only=True)
    assert set(saved) == set(load_file(run / "model.safetensors")) and not any(
        "_orig_mod" in k for k in saved
    )
    carried = artifact_kernels(run / "checkpoints" / "step_00000030" / "compile_artifacts.bin")
    resumed = fit(str(tmp_path / "cache_b"), 60, "resume=auto")  # another node: its cache dir is empty
    assert resumed["compile/cache_misses"] == 0 and resumed["compile/cache_hits"] >= 1, resumed
    # no C++ kernel was built: the fresh cache dir holds exactly what the checkpoint carried
    # (times, with and without the kernels carried: BENCHMARKS.md § Compile)
    assert carried and kernel_files(tmp_path / "cache_b") == carried


def _preempted(run: Path, sig: signal.Signals) -> list[str]:
    """Start the two-epoch run (as two_epoch_run's) in `run`, send it `sig` once it logs step 5, check it
    checkpointed and exited 75 with the one stop line; the command, to resume it."""
    cmd = [sys.executable, "-m", "recipes.train", *TINY, "trainer.max_epochs=2", "trainer.keep_last=5"]
    cmd += ["trainer.log_every=1", f"hydra.run.dir={run}", "precision=fp32"]  # as two_epoch_run's
    proc = subprocess.Popen(
        cmd, cwd=run.parent, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:  # the loop is stepping: logged step 5
        if line.startswith("[step 5/"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    assert (
        err.strip().splitlines()[-1].startswith(f"stopped: {sig.name} after step ") and "Traceback" not in err
    )
    stopped = int(err.strip().splitlines()[-1].split("after step ")[1].split(":")[0])
    assert 5 <= stopped < 46 and (run / "checkpoints" / f"step_{stopped:08d}" / "meta.json").is_file()
    return cmd


@pytest.mark.slow  # SIGUSR1 takes SIGTERM's path once handled: the default run resumes after SIGTERM (#31)
def test_sigusr1_checkpoints_and_exits_75_as_sigterm_does(tmp_path: Path) -> None:
    _preempted(tmp_path / "run", signal.SIGUSR1)


def test_a_preempted_run_checkpoints_exits_75_and_resumes_bit_exact(
    two_epoch_run: Path, tmp_path: Path
) -> None:
    # a real process and a real signal, as a scheduler sends it mid-epoch; also a dead writer's leftovers
    run = tmp_path / "run"
    stale = run / "checkpoints" / ".tmp-step_00000003-999999999"  # no such process
    stale.mkdir(parents=True)
    cmd = _preempted(run, signal.SIGTERM)
    r = subprocess.run(
        cmd + ["resume=auto"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not stale.exists()  # removed at the next start
    a, b = load_file(two_epoch_run / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-exact with the uninterrupted run
    rows = read_metrics(run)
    train_steps = [row["step"] for row in rows if "train/loss" in row]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 46  # no step logged twice


# what a scheduler's launcher does: install its own handler for the preemption signal, then run the training
_PREEMPTED_UNDER_A_HANDLER = textwrap.dedent(
    """
    import json, signal, sys
    from pathlib import Path

    marker, run = Path(sys.argv[1]), Path(sys.argv[2])

    def requeue(signum, frame):  # stands in for submitit's checkpoint-and-requeue handler
        saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
        marker.write_text(json.dumps({"signal": signal.Signals(signum).name, "checkpoints": saved}))

    signal.signal(signal.SIGUSR2, requeue)
    from recipes.train import main
    sys.exit(main(sys.argv[3:]))
    """
)


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_a_stop_signal_checkpoints_then_runs_the_handler_it_replaced_and_resume_continues(
    tmp_path: Path,
) -> None:
    # a real process and a real SIGUSR2 (what submitit asks SLURM to send) mid-run
    run, marker = tmp_path / "run", tmp_path / "requeued.json"
    args = [*TINY, "trainer.max_epochs=2", "trainer.log_every=1", "trainer.keep_last=5"]
    args += [f"hydra.run.dir={run}"]
    cmd = [sys.executable, "-c", _PREEMPTED_UNDER_A_HANDLER, str(marker), str(run), *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and '"train/loss"' in metrics.read_text()):  # the loop is stepping
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(proc.communicate()[1].decode()[-2000:])
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=300)
    err = err.decode()
    assert proc.returncode == 75, err[-2000:]
    stopped = int(err.strip().splitlines()[-1].split("after step ")[1].split(":")[0])
    assert stopped < 46 and (run / "checkpoints" / f"step_{stopped:08d}" / "meta.json").is_file()
    called = json.loads(marker.read_text())  # the replaced handler ran, after the checkpoint was written
    assert called["signal"] == "SIGUSR2" and f"step_{stopped:08d}" in called["checkpoints"]
    r = subprocess.run(
        [sys.executable, "-m", "recipes.train", *args, "resume=auto"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [row["step"] for row in rows if "train/loss" in row]
    assert steps == sorted(set(steps)) and steps[-1] == 46 and (run / "result.json").is_file()


def test_hydra_rerun_is_refused_before_its_pickle_is_read(tmp_path: Path, cli_here) -> None:
    marker = tmp_path / "ran"
    payload = tmp_path / "config.pickle"
    payload.write_bytes(pickle.dumps(_WritesOnLoad(str(marker))))
    r = cli_here("--experimental-rerun", str(payload))
    assert r.returncode == 2 and r.stderr.startswith("error: --experimental-rerun is refused")
    assert r.stderr.count("\n") == 1 and not marker.exists()


class _WritesOnLoad:
    """Unpickling this writes a file: what a crafted Hydra rerun pickle could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.write_text, (Path(self.path), "ran"))


def test_a_truncated_jpeg_is_skipped_and_counted_or_stops_in_one_line(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 50), ("val", 10)):
        for c in ("a", "b"):
            (tmp_path / "tree" / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(tmp_path / "tree" / split / c / f"{i:02d}.jpg")
    broken = tmp_path / "tree" / "train" / "a" / "07.jpg"
    broken.write_bytes(broken.read_bytes()[:400])  # the header reads; the pixels end early
    monkeypatch.chdir(tmp_path)
    args = [
        *TINY,
        "data=imagefolder",
        f"data.root={tmp_path}/tree",
        "data.image_size=16",
        "trainer.batch_size=20",
    ]
    main([*args, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}/skip"])
    rows = read_metrics(tmp_path / "skip")
    assert [r["data/bad_samples"] for r in rows if "data/bad_samples" in r] == [1.0]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "data.on_bad_sample=error", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}/error"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {broken}: ")
