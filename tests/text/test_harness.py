"""text.harness: lm-evaluation-harness's model interface on a torchkiln run scores as lm-eval's own Hugging
Face model (`HFLM`, the reference, test-only) scores the folder `recipes.export format=hf` writes of it: the
same log-likelihood per request to 1e-4 in fp32, the same accuracies, the same greedy text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lm_eval")

from bench.harness import write_tasks  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from recipes.eval import run as run_eval  # noqa: E402
from tests.helpers import TINY_RUN, fault, run_here, train  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny fp32 Llama run of the bytes tokenizer, its format=hf folder)."""
    run = train(tmp_path_factory.mktemp("harness") / "run", [*TINY_RUN, "tokenizer=bytes"])
    assert run_here("recipes.export", f"ckpt={run}", "format=hf").returncode == 0
    return run, run / "export" / "hf"


@pytest.fixture(scope="module")
def pair(exported: tuple[Path, Path]) -> tuple[Any, Any]:
    """(our adapter on the run, lm-eval's HFLM on its exported folder), both fp32 on the CPU."""
    from lm_eval.models.huggingface import HFLM

    from recipes.cli.runs import load_run
    from text.harness import HarnessLM

    run, folder = exported
    loaded = load_run(run, device="cpu", precision="fp32")
    ours = HarnessLM(loaded.model, loaded.task.tokenizer, loaded.plan, batch_size=3)
    theirs = HFLM(pretrained=str(folder), backend="causal", dtype="float32", device="cpu", batch_size=3)
    return ours, theirs


def _requests(kind: str, args: list[tuple]) -> list[Any]:
    """lm-eval Instances of one request type."""
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


#: contexts and continuations: an empty context, a trailing space moved to the continuation, one-token
#: continuations sharing a context, and a pair past the model's 32-token context (left-truncated)
PAIRS = [
    ("", "In the beginning"),
    ("And God said ", "let there be light"),
    ("Day one:", " a"),
    ("Day one:", " b"),
    ("Day one:", " light"),
    ("And the earth was without form, and void; and darkness was upon", " the face of the deep."),
]


def test_loglikelihoods_equal_hflm_per_request(pair: tuple[Any, Any]) -> None:
    ours, theirs = pair
    got = ours.loglikelihood(_requests("loglikelihood", PAIRS))
    want = theirs.loglikelihood(_requests("loglikelihood", PAIRS))
    assert [g[1] for g in got] == [w[1] for w in want]  # greedy flags
    assert torch.tensor([g[0] for g in got]) == pytest.approx(torch.tensor([w[0] for w in want]), abs=1e-4)
    texts = [("In the beginning God created the heaven and the earth. " * 3,), ("Short.",)]
    rolled = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    assert rolled == pytest.approx(
        theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)), abs=1e-4
    )


def test_greedy_generation_gives_hflm_text(pair: tuple[Any, Any]) -> None:
    ours, theirs = pair
    args = [
        ("And God said", {"until": ["."], "max_gen_toks": 12, "do_sample": False}),
        (
            "And God made",
            {"until": ["."], "max_gen_toks": 12, "do_sample": False},
        ),  # one batch with the first
        (
            "And the evening and the morning were",
            {"until": ["."], "max_gen_toks": 12, "do_sample": False},
        ),  # and a longer prompt in the same batch: left-padded, as HFLM pads it
        ("In the", {"until": ["\n\n", "e"], "max_gen_toks": 6, "do_sample": False}),
        ("x" * 40, {"until": ["."], "max_gen_toks": 8, "do_sample": False}),  # left-truncated to 24
    ]
    got = ours.generate_until(_requests("generate_until", args))
    assert got == theirs.generate_until(_requests("generate_until", args))
    assert any(got)  # something was generated


def test_a_repetition_penalty_gives_hflm_text_greedy_and_its_setting_reaches_sampling(
    pair: tuple[Any, Any],
) -> None:
    from text.harness import sampling_options

    ours, theirs = pair
    # one request a kwargs (its own batch): HFLM's left padding would count the pad id as a seen token
    args = [
        (
            "And God said",
            {"until": ["."], "max_gen_toks": 16, "do_sample": False, "repetition_penalty": 50.0},
        ),
        ("And the", {"until": ["."], "max_gen_toks": 16, "do_sample": False, "repetition_penalty": 0.7}),
    ]
    got = ours.generate_until(_requests("generate_until", args))
    assert got == theirs.generate_until(_requests("generate_until", args))
    plain = [(c, {k: v for k, v in kw.items() if k != "repetition_penalty"}) for c, kw in args]
    assert got != ours.generate_until(_requests("generate_until", plain))  # the penalty changed the text
    sampled = sampling_options(
        {"do_sample": True, "temperature": 0.7, "min_p": 0.1, "repetition_penalty": 1.2}
    )
    assert sampled == {"temperature": 0.7, "min_p": 0.1, "repetition_penalty": 1.2}


def test_task_accuracies_equal_hflm(pair: tuple[Any, Any], tmp_path: Path) -> None:
    from text.harness import evaluate_tasks, task_manager

    ours, theirs = pair
    manager = task_manager(["tiny_all"], [write_tasks(tmp_path / "tasks")])
    got, want = (evaluate_tasks(lm, ["tiny_all"], manager)["results"] for lm in (ours, theirs))
    for task, metric in [
        ("tiny_mc", "acc,none"),
        ("tiny_mc", "acc_norm,none"),
        ("tiny_gen", "exact_match,none"),
    ]:
        assert got[task][metric] == want[task][metric]
    assert got["tiny_ppl"]["bits_per_byte,none"] == pytest.approx(
        want["tiny_ppl"]["bits_per_byte,none"], rel=1e-5
    )


def test_the_cli_writes_lm_eval_s_results_for_the_run_and_its_hf_folder(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    run, folder = exported
    tasks = write_tasks(tmp_path / "tasks")
    written = {}
    for ckpt, out in ((run, run / "eval" / "harness"), (folder, tmp_path / "hf")):
        args = [
            f"ckpt={ckpt}",
            "harness.tasks=[tiny_mc,tiny_gen]",
            f"harness.include=[{tasks}]",
            "harness.limit=3",
        ]
        proc = run_here(
            "recipes.eval", *args, "device=cpu", "precision=fp32", *([f"out={out}"] if ckpt == folder else [])
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        (file,) = out.glob("results_*.json")  # lm-eval's own file name and form
        written[ckpt] = json.loads(file.read_text())
        assert "tiny_mc" in proc.stdout and "acc_norm" in proc.stdout  # lm-eval's table
    ours, theirs = (written[k]["results"] for k in (run, folder))
    assert set(ours) == {"tiny_mc", "tiny_gen"}
    for task in ours:
        assert {k: v for k, v in ours[task].items() if k != "alias"} == {
            k: v for k, v in theirs[task].items() if k != "alias"
        }
    assert written[run]["n-samples"]["tiny_mc"]["effective"] == 3  # harness.limit


def test_a_chat_template_the_run_lacks_is_one_line_exit_2(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = exported
    tasks = write_tasks(tmp_path / "tasks")
    args = [
        f"ckpt={run}",
        "harness.tasks=[tiny_mc]",
        f"harness.include=[{tasks}]",
        "harness.apply_chat_template=true",
    ]
    proc = run_here("recipes.eval", *args, f"out={tmp_path / 'out'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    with pytest.raises(ConfigError) as e:
        run_eval([*args, f"out={tmp_path / 'out'}"])
    assert fault(e.value)[:2] == ("harness.apply_chat_template", "true")
    assert not (tmp_path / "out").exists()  # nothing written


def two_ranks(module: str, *argv: str, cwd: Path | None = None) -> None:
    """`python -m MODULE ARGV...` under torchrun with 2 gloo ranks on the CPU; asserts it exits 0."""
    import subprocess
    import sys

    from tests.helpers import dist_env_vars

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*launch, "-m", module, *argv],
        env=dist_env_vars(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow  # two gloo ranks, each importing torch, lm-eval and the run
def test_two_data_parallel_ranks_give_the_one_process_results(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = exported
    tasks = write_tasks(tmp_path / "tasks", docs=7)  # 21 requests: the ranks' shares differ by one
    args = [
        f"ckpt={run}",
        "harness.tasks=[tiny_all]",
        f"harness.include=[{tasks}]",
        "device=cpu",
        "precision=fp32",
    ]
    one = run_here("recipes.eval", *args, f"out={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    two_ranks("recipes.eval", *args, f"out={tmp_path / 'two'}")
    (first,), (second,) = (
        (tmp_path / d).glob("results_*.json") for d in ("one", "two")
    )  # rank 0 alone writes
    ours, theirs = (json.loads(f.read_text())["results"] for f in (first, second))
    assert set(ours) == set(theirs)
    for task, metrics in ours.items():  # gathered, the stderrs sum in another order: ulps apart
        numbers = {k: v for k, v in metrics.items() if isinstance(v, float)}
        assert numbers == pytest.approx({k: theirs[task][k] for k in numbers}, rel=1e-6), task
    assert ours["tiny_mc"]["acc,none"] == theirs["tiny_mc"]["acc,none"]


def test_a_continuation_longer_than_the_context_is_one_line_exit_2(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = exported
    tasks = write_tasks(tmp_path / "tasks")
    row = {"question": "Which?", "choices": ["light", "x" * 40, "y"], "answer": 0}  # " " + 40 bytes > 32
    (tasks / "mc.jsonl").write_text(json.dumps(row) + "\n")
    args = [f"ckpt={run}", "harness.tasks=[tiny_mc]", f"harness.include=[{tasks}]", f"out={tmp_path / 'out'}"]
    assert run_here("recipes.eval", *args).returncode == 2
    with pytest.raises(ConfigError) as e:
        run_eval(args)
    assert fault(e.value) == ("task.context", "32", (">= 41",))
    assert not (tmp_path / "out").exists()


def test_the_embedded_benchmarks_are_included_by_default(exported: tuple[Path, Path], tmp_path: Path) -> None:
    run, _ = exported
    args = [f"ckpt={run}", "harness.tasks=[kjv_nonesuch]"]
    with pytest.raises(ConfigError) as e:
        run_eval(args)
    key, value, valid = fault(e.value)
    assert (key, value) == ("harness.tasks", "kjv_nonesuch")
    assert {"kjv", "kjv_book_mc", "kjv_cloze"} <= set(valid)  # text.benchmarks.task_folder()'s


@pytest.mark.slow  # a training run that scores two embedded benchmarks at its evaluations
def test_trainer_evals_log_the_embedded_benchmarks_and_their_centred_accuracy(tmp_path: Path) -> None:
    from recipes.cli.curves import curves_figure, describe
    from tests.helpers import read_metrics
    from text.benchmarks import baseline

    tiny = [o for o in TINY_RUN if not o.startswith("task.context=")]  # kjv choices need 128 positions
    evals = ["trainer.evals=[kjv_book_mc,kjv_book_gen]", "trainer.evals_limit=2", "trainer.eval_every=1"]
    run = train(tmp_path / "run", [*tiny, "task.context=128", "tokenizer=bytes", *evals])
    rows = [r for r in read_metrics(run) if "val/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # beside val/loss, at each evaluation
        acc = row["eval/kjv_book_mc/acc"]
        assert acc in (0.0, 0.5, 1.0)  # 2 documents
        want = (acc - baseline("kjv_book_mc")) / (1 - baseline("kjv_book_mc"))
        assert row["eval/kjv_book_mc/centered_acc"] == pytest.approx(want)
        assert "eval/kjv_book_gen/exact_match" in row and "eval/kjv_book_gen/centered_exact_match" in row
    panels = describe(curves_figure(run, "val/loss"))["panels"]  # the run's curves.png draws them
    assert "eval/kjv_book_mc/centered_acc" in panels["benchmarks"]["series"]


@pytest.mark.slow  # a tiny training run alone and under torchrun with 2 ranks, each scoring at evaluations
def test_trainer_evals_under_two_ddp_ranks_log_the_one_process_scores(tmp_path: Path) -> None:
    from tests.helpers import read_metrics

    tiny = [o for o in TINY_RUN if not o.startswith("task.context=")]  # kjv choices need 128 positions
    evals = ["trainer.evals=[kjv_book_mc,kjv_book_gen]", "trainer.evals_limit=4", "trainer.eval_every=1"]
    args = [*tiny, "task.context=128", "tokenizer=bytes", *evals, "trainer.parallel=ddp", "device=cpu"]
    one = train(tmp_path / "one", args)
    two_ranks("recipes.train", *args, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)

    def scores(run: Path) -> list[dict[str, float]]:
        return [
            {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in read_metrics(run)
            if "val/loss" in r
        ]

    got, want = scores(tmp_path / "two"), scores(one)
    assert len(got) == len(want) == 2 and all("eval/kjv_book_mc/acc" in row for row in got)
    for row, ref in zip(got, want, strict=True):  # rank 0 scored the whole tasks, as one process does
        assert row == pytest.approx(ref, abs=1e-6)
