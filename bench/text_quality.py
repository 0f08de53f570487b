"""Quality of the text recipes with their defaults: the LM's validation loss and wall time, and the classifier
against a bag-of-words logistic regression on the same split. `python -m bench.text --parts lm,cls`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_recipe(task: str, run_dir: Path, *overrides: str) -> tuple[dict, float]:
    """`python -m recipes.train +task=TASK` in a subprocess; (final metrics, wall seconds)."""
    cmd = [sys.executable, "-m", "recipes.train", f"+task={task}", f"hydra.run.dir={run_dir}"]
    cmd += ["trainer.progress=false", *overrides]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())["metrics"], wall


def lm_quality(tmp: Path) -> dict[str, float]:
    """The default LM recipe: final validation loss in nats per byte, and wall time."""
    metrics, wall = run_recipe("lm", tmp / "lm")
    out = {"lm_val_loss": metrics["val/loss"], "lm_wall_s": wall}
    print(f"lm     default recipe: val loss {out['lm_val_loss']:.3f} nats/byte in {wall:.0f} s "
          f"(target <= 1.6 within 300 s)", flush=True)  # fmt: skip
    return out


def cls_quality(tmp: Path) -> dict[str, float]:
    """The default classification recipe vs a bag-of-words logistic regression on the same split."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    from text.datasets import kjv_groups

    data = kjv_groups()
    t = time.perf_counter()
    vec = CountVectorizer()
    x_train = vec.fit_transform([x for x, _ in data.train])
    # One BLAS thread: on a shared 2-core machine, spinning BLAS threads only slow lbfgs down.
    with threadpool_limits(1):
        clf = LogisticRegression(max_iter=2000).fit(x_train, [y for _, y in data.train])
    pred = clf.predict(vec.transform([x for x, _ in data.val]))
    bow = float((pred == [y for _, y in data.val]).mean())
    bow_wall = time.perf_counter() - t
    metrics, wall = run_recipe("text_classification", tmp / "cls")
    out = {"bow_lr_accuracy": bow, "bow_lr_wall_s": bow_wall, "cls_accuracy": metrics["val/accuracy"],
           "cls_wall_s": wall}  # fmt: skip
    print(f"cls    BoW logistic regression {bow:.4f} ({bow_wall:.0f} s) | recipe {out['cls_accuracy']:.4f} "
          f"({wall:.0f} s) | {'beats' if out['cls_accuracy'] > bow else 'does NOT beat'} the baseline",
          flush=True)  # fmt: skip
    return out
