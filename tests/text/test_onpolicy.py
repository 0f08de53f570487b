"""On-policy distillation (`+task=distill task.on_policy=true data=prompts`, text/distill.py): the loss on the
student's own samples equals TRL's GKD loss on those tokens (through `GKDTrainer.generalized_jsd_loss`
itself); prompt and padding positions carry no gradient; a student that is its teacher has no loss;
task.lmbda=0 completes the prompts with their answers; settings that cannot work are one line naming the
key (exit 2, before training); a run trains, evaluates and writes its completions, and resumes bit-exact
after kill -9."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.rng import derive_seed
from tests.helpers import counted_compiles, dist_env_vars, killed_and_resumed, read_metrics, run_here, train
from tests.text import test_distill
from tests.text.test_distill import SIZES, teacher_run
from text.distill import Distillation
from text.lm_data import IGNORE
from text.rollouts import pack_rollout

CONTEXT = 96
#: TRL's GKD loss, the reference (a fixture: skipped where trl is not installed)
trl_gkd = test_distill.trl_gkd


def _task(teacher: Path, **options: Any) -> Distillation:
    settings = {"on_policy": True, "group_size": 2, "max_new_tokens": 6, "context": CONTEXT, **options}
    return Distillation(
        model={"name": "llama", **SIZES},
        data={"name": "prompts", "count": 40},
        teacher=str(teacher),
        **settings,
    )


def _step(task: Distillation) -> tuple[torch.nn.Module, Any, list[Any]]:
    """(a tiny student, the output of its step, the rows): one step on 3 training prompts."""
    train_set, _ = task.build_datasets()
    torch.manual_seed(0)
    student = task.build_model()
    rows = [train_set[i] for i in range(3)]
    return student, task.step(student, task.collate_fn()(rows)), rows


def _sampled_again(task: Distillation, student: torch.nn.Module, rows: list[Any]) -> tuple[torch.Tensor, ...]:
    """(tokens, mask) of the first step's completions, sampled again from the generator it drew (the run
    seed 0, rank 0, generation 1)."""
    g = torch.Generator().manual_seed(derive_seed(0, "grpo-sampling", 0, 1))
    completions = task.sample(student, rows, g).ids
    texts = [task.completion_text(c) for c in completions[: task.group_size]]
    assert task.rollouts.samples[0]["completions"] == texts  # what the step sampled
    prompts = [r.ids for r in rows for _ in range(task.group_size)]
    return pack_rollout(prompts, completions, task.tokenizer.pad_id)


@pytest.mark.parametrize(("beta", "temperature"), [(0.5, 1.0), (0.1, 0.7), (1.0, 1.3)])
def test_the_loss_equals_trls_gkd_loss_on_the_students_samples(
    tmp_path: Path, trl_gkd: Any, beta: float, temperature: float
) -> None:
    task = _task(teacher_run(tmp_path / "teacher"), beta=beta, temperature=temperature, top_p=0.9)
    student, out, rows = _step(task)
    tokens, mask = _sampled_again(task, student, rows)
    assert mask.any() and not mask.all()  # completions of unequal lengths: padding to leave out
    with torch.no_grad():
        s = student(tokens[:, :-1]).double()
        t = task.teacher.model(tokens[:, :-1]).double()
    labels = tokens[:, 1:].masked_fill(~mask, IGNORE)
    want = trl_gkd(s, t, labels=labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(out.loss.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.metrics["divergence"].double(), want, rtol=0, atol=1e-5)


def test_the_student_exports_from_batches_of_prompts(tmp_path: Path) -> None:
    task = _task(teacher_run(tmp_path / "teacher"))
    _, val = task.build_datasets()
    rows = [val[i] for i in range(len(val))]
    rows[1] = dataclasses.replace(rows[1], ids=rows[1].ids[:-2])  # prompts of two lengths
    inputs = task.export_inputs(task.build_model().eval(), task.collate_fn()(rows))
    shortest = min(len(r.ids) for r in rows)
    assert inputs.args[0].tolist() == [r.ids[:shortest] for r in rows]


def test_prompt_and_padding_positions_carry_no_gradient(tmp_path: Path) -> None:
    task = _task(teacher_run(tmp_path / "teacher"))
    logits: list[torch.Tensor] = []
    original = task.build_model

    def keep(module: torch.nn.Module, inputs: Any, out: torch.Tensor) -> None:
        if out.requires_grad:  # the step's forward, not the sampler's
            out.retain_grad()
            logits.append(out)

    def build() -> torch.nn.Module:
        model = original()
        model.register_forward_hook(keep)
        return model

    task.build_model = build  # type: ignore[method-assign]
    student, out, rows = _step(task)
    out.loss.backward()
    _, mask = _sampled_again(task, student, rows)
    grad = logits[0].grad
    assert grad is not None and grad.shape[:2] == mask.shape
    assert grad[~mask].abs().max() == 0 and (grad[mask].abs().sum(-1) > 0).all()


def test_a_student_that_is_its_teacher_has_no_loss(tmp_path: Path) -> None:
    task = _task(teacher_run(tmp_path / "teacher"), beta=0.3)
    task.build_datasets()
    student = copy.deepcopy(task.teacher.model).train().requires_grad_(True)
    batch = task.collate_fn()([task.build_datasets()[0][i] for i in range(3)])
    out = task.step(student, batch)
    assert out.metrics["completion_length"] > 0
    torch.testing.assert_close(out.loss, torch.zeros(()), rtol=0, atol=1e-6)


def test_a_compiled_student_sees_length_buckets_and_gives_the_eager_divergences(tmp_path: Path) -> None:
    # completions change the rows' length each step: a compiled student's forward sees them padded to a
    # length bucket (that dim static), so two lengths of one bucket share a graph, with eager's divergences
    task = _task(teacher_run(tmp_path / "teacher"), beta=0.3)
    task.build_datasets()
    torch.manual_seed(0)
    eager = task.build_model().train()
    student = copy.deepcopy(eager)
    per_length = []
    with counted_compiles(student) as compiles:
        for n in (41, 46, 61):  # forward widths 40 and 45 (bucket 48), then 60 (64)
            tokens = torch.randint(1, 200, (4, n))
            want = task._divergences(eager, tokens)  # fills the attention dispatch's caches first
            got = task._divergences(student, tokens)
            assert got.shape == (4, n - 1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            per_length.append(len(compiles))
    assert per_length[0] > 0 and per_length == [per_length[0], per_length[0], 2 * per_length[0]]


def test_lmbda_0_completes_the_prompts_with_their_answers(tmp_path: Path) -> None:
    # room for the answer and the end of turn (cut, as the student's, to max_new_tokens)
    task = _task(teacher_run(tmp_path / "teacher"), lmbda=0.0, max_new_tokens=16)
    _, out, rows = _step(task)
    assert task.rollouts.samples[-1]["completions"] == [rows[0].fields["answer"]]
    assert out.metrics["completion_length"] == len(rows[0].fields["answer"]) + len("<|im_end|>")
    assert task.rollouts.generations == 1  # the draw comes from the generation's own generator


def test_settings_on_policy_cannot_use_are_one_line_naming_the_key(tmp_path: Path) -> None:
    teacher = teacher_run(tmp_path / "teacher")
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cases = {
        "task.on_policy": {"data": {"name": "text_files", "root": str(text)}},
        "task.teacher_logprobs": {"teacher_logprobs": str(tmp_path)},
        "task.hard_weight": {"hard_weight": 0.5},
        "task.max_new_tokens": {"max_new_tokens": CONTEXT},
    }
    for key, options in cases.items():
        with pytest.raises(ConfigError) as e:
            if "data" in options:
                Distillation(
                    model={"name": "llama", **SIZES}, teacher=str(teacher), on_policy=True, **options
                )
            else:
                _task(teacher, **options)
        assert e.value.key == key
    # prompts without on_policy: found when the data are built, before training
    with pytest.raises(ConfigError) as e:
        _task(teacher, on_policy=False).build_datasets()
    assert (e.value.key, e.value.value) == ("task.on_policy", "false")
    run = tmp_path / "run"
    r = run_here(
        "recipes.train",
        "+task=distill",
        "task.on_policy=true",
        f"task.teacher={teacher}",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 2 and "task.on_policy" in r.stderr.strip().splitlines()[-1]
    assert not (run / "checkpoints").exists()


def tiny_run(teacher: Path) -> list[str]:
    """A few steps of on-policy distillation of a tiny student on the embedded prompts."""
    return [
        "+task=distill",
        "task.on_policy=true",
        "data=prompts",
        "data.count=40",
        f"task.teacher={teacher}",
        "model=llama",
        *(f"model.{k}={v}" for k, v in SIZES.items()),
        "logger=none",
        "precision=fp32",
        "compile.policy=off",
        f"task.context={CONTEXT}",
        "task.group_size=2",
        "task.max_new_tokens=5",
        "trainer=smoke",
        "trainer.batch_size=2",
        "trainer.limit_val_batches=2",
        "optim.lr=1e-2",
    ]


def test_a_run_trains_evaluates_and_writes_its_completions(tmp_path: Path) -> None:
    run = train(tmp_path / "run", [*tiny_run(teacher_run(tmp_path / "teacher")), "trainer.max_steps=2"])
    rows = read_metrics(run)
    trained = [r for r in rows if "train/loss" in r]
    assert trained and all(r["train/loss"] == pytest.approx(r["train/divergence"]) for r in trained)
    val = [r for r in rows if "val/divergence" in r][-1]
    assert val["val/loss"] == val["val/divergence"] > 0 and 0 <= val["val/exact_match"] <= 1
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2] and len(samples[0]["completions"]) == 2
    assert (run / "model.safetensors").is_file()


@pytest.mark.slow  # two short recipe runs in processes of their own (~40 s on 2 loaded cores)
def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    steps = ["trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.keep_last=20", "trainer.export=last"]
    args = [*tiny_run(teacher_run(tmp_path / "teacher")), *steps, "task.lmbda=0.5"]
    killed_and_resumed([sys.executable, "-m", "recipes.train", *args], tmp_path, 2, dist_env_vars())
