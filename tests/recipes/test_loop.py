"""Around the loop, through the CLI in real processes: the best checkpoint exported, early stopping resumed
exactly after a real SIGTERM, debug modes, and output fit for a log file."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from recipes.eval import main as evaluate
from tests.helpers import cli_env, read_metrics

TINY = ["+task=image_classification", "trainer.progress=false", "model.width=16"]


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_the_digits_run_exports_its_best_checkpoint(tmp_path: Path, cli_here) -> None:
    run = tmp_path / "run"
    r = cli_here(
        *TINY, "trainer.max_epochs=3", "trainer.eval_every=7", "trainer.keep_last=1", f"hydra.run.dir={run}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((run / "result.json").read_text())
    best = Path(result["exported"])
    assert best.parent == run / "checkpoints" and (best / "meta.json").is_file()
    meta = json.loads((best / "meta.json").read_text())
    assert meta["monitor"] == {"key": "val/accuracy", "value": result["metrics"]["best/val/accuracy"]}
    exported, kept = load_file(run / "model.safetensors"), torch.load(best / "model.pt", weights_only=True)
    assert exported.keys() == kept.keys() and all(torch.equal(exported[k], kept[k]) for k in kept)
    # its score, measured again from the file by recipes.eval (the loop's own evaluation, from the run's
    # config), is the run's best/val/accuracy
    assert evaluate([f"ckpt={run}", f"out={tmp_path / 'eval.json'}"]) == 0
    again = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    assert again["val/accuracy"] == result["metrics"]["best/val/accuracy"]
    # trainer.export=last exports the last step's weights instead
    last = tmp_path / "last"
    r = cli_here(*TINY, "trainer.max_epochs=1", "trainer.export=last", f"hydra.run.dir={last}")
    assert r.returncode == 0 and json.loads((last / "result.json").read_text())["exported"] == "last step"


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_early_stopping_survives_a_real_sigterm_and_resume(tmp_path: Path, cli) -> None:
    # min_delta larger than any change: the first evaluation stays the best; two more stop the run
    args = [*TINY, "trainer.max_epochs=4", "trainer.eval_every=4", "trainer.log_every=1"]
    args += ["trainer.monitor=val/loss", "early_stop.patience=2", "early_stop.min_delta=5"]
    a = tmp_path / "a"
    r = cli(*args, f"hydra.run.dir={a}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert any(line.startswith("early stop: val/loss") for line in r.stdout.splitlines())
    stopped_at = json.loads((a / "result.json").read_text())["metrics"]["step"]
    assert stopped_at == 12  # evaluations at steps 4, 8 and 12 of a 92-step plan
    b = tmp_path / "b"
    cmd = [sys.executable, "-m", "recipes.train", *args, f"hydra.run.dir={b}"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("[step 6/"):  # between the first and second evaluation
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    r = cli(*args, "resume=auto", f"hydra.run.dir={b}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((b / "result.json").read_text())["metrics"]["step"] == stopped_at
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    evals = lambda run: [(x["step"], x["val/loss"]) for x in read_metrics(run) if "val/loss" in x]  # noqa: E731
    assert evals(a) == evals(b)


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_debug_overfit_passes_a_model_that_fits_and_fails_one_that_cannot(tmp_path: Path, cli_here) -> None:
    r = cli_here(*TINY, "debug=overfit", f"hydra.run.dir={tmp_path / 'ok'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert any(line.startswith("overfit check:") for line in r.stdout.splitlines())
    steps = [x["step"] for x in read_metrics(tmp_path / "ok") if "train/loss" in x]
    assert steps[-1] == 100
    r = cli_here(*TINY, "debug=overfit", "optim.lr=1e-9", f"hydra.run.dir={tmp_path / 'bad'}")
    assert r.returncode == 3 and "trainer.overfit_batches=1" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_debug_limit_and_profile(tmp_path: Path, cli_here) -> None:
    r = cli_here(*TINY, "debug=limit", "trainer.max_epochs=3", f"hydra.run.dir={tmp_path / 'limit'}")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_metrics(tmp_path / "limit")
    # 10 batches an epoch (of the 23 the data has), an evaluation after each
    assert [x["step"] for x in rows if "val/loss" in x] == [10, 20, 30]
    r = cli_here(*TINY, "debug=profile", f"hydra.run.dir={tmp_path / 'prof'}")
    assert r.returncode == 0, r.stderr[-2000:]
    trace = json.loads((tmp_path / "prof" / "profile" / "trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::conv") for e in trace["traceEvents"])
    assert "aten::" in (tmp_path / "prof" / "profile" / "top_ops.txt").read_text()
    assert json.loads((tmp_path / "prof" / "result.json").read_text())["metrics"]["step"] == 7  # then stopped


def test_debug_anomaly_turns_the_detector_on(tmp_path: Path, cli_here) -> None:
    r = cli_here(*TINY, "debug=anomaly", "--cfg", "job")
    cfg = OmegaConf.create(r.stdout)
    assert r.returncode == 0 and cfg.trainer.detect_anomaly is True and cfg.trainer.nonfinite == "abort"


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_output_to_a_file_has_no_bar_each_line_once_and_the_same_lines_in_train_log(
    tmp_path: Path, cli
) -> None:
    run = tmp_path / "run"
    r = cli("+task=image_classification", "trainer.max_steps=30", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stdout + r.stderr  # progress on (the default), but stdout/stderr are files
    lines = r.stdout.splitlines()
    assert len(lines) == len(set(lines))  # each message once (the compile decision was printed twice)
    assert sum("compile.policy=" in x for x in lines) == 1
    assert not any(x.startswith("warning: WARNING") for x in lines)
    log = (run / "train.log").read_text()
    assert all(x in log for x in lines)
    assert "[step 30/30]" in r.stdout  # the step lines count to max_steps


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_on_a_terminal_the_bar_counts_the_run_s_steps(tmp_path: Path) -> None:
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 wide
    cmd = [sys.executable, "-m", "recipes.train", *TINY[:1], "model.width=16", "trainer.max_steps=30"]
    cmd.append(f"hydra.run.dir={tmp_path / 'run'}")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=child)
    os.close(child)
    seen = b""
    while True:
        ready, _, _ = select.select([main], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0
    text = seen.decode(errors="replace")
    assert "/30" in text and "epoch 1/15" not in text  # the bar's total is max_steps, not the epoch's


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.monitor_mode=sideways", "trainer.monitor_mode"),
        pytest.param("trainer.keep_best=-1", "trainer.keep_best", marks=pytest.mark.slow),
        pytest.param("trainer.export=first", "trainer.export", marks=pytest.mark.slow),
        pytest.param("early_stop.patience=-2", "early_stop.patience", marks=pytest.mark.slow),
        pytest.param("debug=bogus", "debug", marks=pytest.mark.slow),
    ],
)
def test_bad_loop_settings_fail_before_any_work(tmp_path: Path, cli_here, override: str, key: str) -> None:
    r = cli_here(*TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and key in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
