"""Logit distillation (`+task=distill`, text/distill.py and text/teacher.py): the generalised JSD equals TRL's
GKD loss (through `GKDTrainer.generalized_jsd_loss` itself, float64), is 0 when student = teacher and is the
forward / reverse KL at beta 0 / 1; the teacher loads from a run or its Hugging Face export; top-k stored by
`recipes.prepare` over the whole vocabulary gives the online teacher's loss; a teacher that cannot load or
has another vocabulary is one line naming task.teacher (exit 2, before training); a killed run resumes to
the uninterrupted weights, with the online teacher and with stored top-k."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from core.errors import ConfigError
from tests.helpers import dist_env_vars, killed_and_resumed, read_metrics, run_here, train
from text.distill import Distillation, generalized_jsd, kept_mean, top_k_and_rest
from text.llama import DecoderConfig, Llama
from text.lm_data import IGNORE
from text.teacher import check_vocabulary, load_teacher
from text.tokenizer import BPETokenizer, ByteTokenizer, write_hf_tokenizer

SIZES = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
CONTEXT = 32
TINY = [
    "model=llama",
    *(f"model.{k}={v}" for k, v in SIZES.items()),
    "logger=none",
    "precision=fp32",
    "compile.policy=off",
    f"task.context={CONTEXT}",
    "trainer.batch_size=4",
]


@pytest.fixture(scope="module")
def trl_gkd() -> Any:
    """TRL's GKD loss, the reference (the test-only hf extra)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd = pytest.importorskip("trl.experimental.gkd")
    return gkd.GKDTrainer.generalized_jsd_loss


def _logits(seed: int, shape: tuple[int, ...] = (2, 5, 11)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


# importing trl.experimental.gkd (transformers' Trainer, datasets, accelerate) takes 4 s on a quiet 2-vCPU
# host (17-34 s when three other jobs share it), once per session; the checks take milliseconds
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_generalized_jsd_equals_trls_gkd_loss(trl_gkd: Any, beta: float, temperature: float) -> None:
    student, teacher = _logits(0), _logits(1)
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    labels[0, :2] = labels[1, 4] = IGNORE
    ours = generalized_jsd(student, teacher, beta=beta, temperature=temperature)
    # with labels: TRL's batchmean is a mean over the kept positions, as the task's loss
    want = trl_gkd(student, teacher, labels=labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(kept_mean(ours, labels), want, rtol=0, atol=1e-6)
    # without: TRL's batchmean divides the sum by the batch size, its "none" keeps every element
    want = trl_gkd(student, teacher, beta=beta, temperature=temperature)
    torch.testing.assert_close(ours.sum() / 2, want, rtol=0, atol=1e-6)
    each = trl_gkd(student, teacher, beta=beta, temperature=temperature, reduction="none").sum(-1)
    torch.testing.assert_close(ours, each, rtol=0, atol=1e-6)


def test_the_divergence_is_zero_for_the_teacher_itself_and_kl_at_the_ends() -> None:
    s, t = _logits(3), _logits(4)
    for beta in (0.0, 0.3, 1.0):
        zero = generalized_jsd(t, t + 5.0, beta=beta, temperature=0.7)  # an offset per row changes nothing
        torch.testing.assert_close(zero, torch.zeros_like(zero), rtol=0, atol=1e-12)
    dist = torch.distributions
    p, q = dist.Categorical(logits=t), dist.Categorical(logits=s)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.0), dist.kl_divergence(p, q), rtol=0, atol=1e-12)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1.0), dist.kl_divergence(q, p), rtol=0, atol=1e-12)


def test_top_k_and_the_rest_give_the_full_loss_at_k_equal_to_the_vocabulary_and_hold_the_mass() -> None:
    s, t = _logits(5), _logits(6)
    top = torch.log_softmax(t, -1).topk(11, dim=-1)
    for beta in (0.0, 0.5, 1.0):
        full = generalized_jsd(s, t, beta=beta, temperature=1.5)
        topk = generalized_jsd(*top_k_and_rest(s, top.indices, top.values), beta=beta, temperature=1.5)
        torch.testing.assert_close(topk, full, rtol=0, atol=1e-9)
    # k < V: zero for the teacher itself; positive for a student with the teacher's top-3 ratios whose mass
    # sits elsewhere (renormalising the student over the k alone would score it 0)
    top = torch.log_softmax(t, -1).topk(3, dim=-1)
    zero = generalized_jsd(*top_k_and_rest(t, top.indices, top.values), beta=0.0)
    torch.testing.assert_close(zero, torch.zeros_like(zero), rtol=0, atol=1e-9)
    elsewhere = t.scatter_add(-1, top.indices, torch.full_like(top.values, -8.0))
    assert (generalized_jsd(*top_k_and_rest(elsewhere, top.indices, top.values), beta=0.0) > 0.1).all()


# -- teachers on disk -------------------------------------------------------------------------------------


def teacher_run(root: Path, seed: int = 0, weights: dict[str, float] | None = None) -> Path:
    """A bytes-tokenizer lm run directory holding a tiny random Llama (its config and model.safetensors)."""
    from safetensors.torch import save_model

    torch.manual_seed(seed)
    model = Llama(DecoderConfig(vocab_size=ByteTokenizer.vocab_size, context=CONTEXT, **SIZES))
    with torch.no_grad():
        model.tok_emb.weight.mul_(20)  # a peaked distribution, so a student has something to learn
        for name, value in (weights or {}).items():
            model.get_parameter(name).fill_(value)
    (root / ".hydra").mkdir(parents=True)
    cfg = {
        "task": {"name": "lm", "tokenizer": "bytes", "context": CONTEXT},
        "model": {"name": "llama", **SIZES},
    }
    (root / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    save_model(model, str(root / "model.safetensors"))
    return root


def test_a_teacher_loads_from_its_run_and_its_hugging_face_export(tmp_path: Path) -> None:
    run = load_teacher(str(teacher_run(tmp_path / "run")), CONTEXT)
    hf_folder(run.model, ByteTokenizer(), tmp_path / "hf")
    hf = load_teacher(str(tmp_path / "hf"), CONTEXT)
    for teacher in (run, hf):  # both are the student's vocabulary: the bytes run's and its export's
        check_vocabulary(teacher, ByteTokenizer(), "t", ByteTokenizer.vocab_size)
    x = torch.randint(0, 256, (2, CONTEXT))
    torch.testing.assert_close(hf.model(x), run.model(x))
    assert not any(p.requires_grad for p in hf.model.parameters())


def hf_folder(model: torch.nn.Module, tok: Any, root: Path) -> Path:
    """`model` and `tok` written as a Hugging Face folder, as `recipes.export format=hf` writes a run."""
    from text.checkpoints.hf import write_folder

    write_folder(model, root)
    ids = write_hf_tokenizer(tok, root, context=CONTEXT)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **ids}))
    return root


def other_vocabulary(root: Path, cache: Path) -> Path:
    """A Hugging Face folder whose tokenizer is a BPE vocabulary, not the student's bytes."""
    tok = BPETokenizer.train(["in the beginning god created the heaven and the earth"] * 20, 300, cache)
    return hf_folder(Llama(DecoderConfig(vocab_size=tok.vocab_size, context=CONTEXT, **SIZES)), tok, root)


def test_a_teacher_that_cannot_load_or_has_another_vocabulary_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    broken = teacher_run(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    teachers = {
        "none given": "",
        "missing": tmp_path / "nowhere",
        "broken": broken,
        "vocabulary": other_vocabulary(tmp_path / "bpe", tmp_path / "cache"),
    }
    for name, teacher in teachers.items():
        with pytest.raises(ConfigError) as e:
            task = Distillation(
                model={"name": "llama", **SIZES},
                data={"name": "text_files", "root": str(tmp_path / "text")},
                teacher=str(teacher),
                context=CONTEXT,
            )
            task.build_datasets()
        assert (e.value.key, e.value.value) == ("task.teacher", str(teacher)), name
    # through the command line: the one line, exit 2, before any training
    data = ["data=text_files", f"data.root={tmp_path / 'text'}", "trainer=smoke"]
    run, teacher = tmp_path / "run", teachers["vocabulary"]
    r = run_here(
        "recipes.train", "+task=distill", *TINY, *data, f"task.teacher={teacher}", f"hydra.run.dir={run}"
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"task.teacher={teacher}" in r.stderr.strip().splitlines()[-1]
    assert not (run / "checkpoints").exists()


# -- runs ----------------------------------------------------------------------------------------------------


def corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for i in range(12):
        (root / f"{i:02d}.txt").write_text(f"doc {i}: " + "the quick brown fox jumps. " * (3 + i % 4))
    return root


def test_stored_top_k_of_the_whole_vocabulary_gives_the_online_teachers_loss(tmp_path: Path) -> None:
    teacher = teacher_run(tmp_path / "teacher")
    shards = tmp_path / "shards"
    args = [f"data.root={corpus(tmp_path / 'text')}", f"out={shards}", "data.val_fraction=0.3", "workers=1"]
    args += ["progress=false", f"teacher={teacher}", f"teacher_top_k={ByteTokenizer.vocab_size}"]
    r = run_here("recipes.prepare", "+task=lm", *args, f"task.context={CONTEXT}")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((shards / "teacher" / "manifest.json").read_text())
    assert manifest["k"] == ByteTokenizer.vocab_size and manifest["splits"]["train"]["positions"] > 0
    written = (shards / "teacher" / "train-ids.npy").stat().st_mtime_ns
    again = run_here("recipes.prepare", "+task=lm", *args, f"task.context={CONTEXT}")
    assert again.returncode == 0 and (shards / "teacher" / "train-ids.npy").stat().st_mtime_ns == written

    def task(**kw: str) -> Distillation:
        data = {"name": "tokens", "path": str(shards)}
        return Distillation(model={"name": "llama", **SIZES}, data=data, context=CONTEXT, **kw)

    online, stored = task(teacher=str(teacher)), task(teacher_logprobs=str(shards / "teacher"))
    torch.manual_seed(0)
    student = online.build_model()
    for split in (0, 1):
        a, b = online.build_datasets()[split], stored.build_datasets()[split]
        batch_a = [torch.stack(t) for t in zip(*(a[i] for i in range(3)), strict=True)]
        batch_b = [torch.stack(t) for t in zip(*(b[i] for i in range(3)), strict=True)]
        assert all(torch.equal(u, v) for u, v in zip(batch_a, batch_b[:3], strict=True))
        got, want = stored.step(student, batch_b), online.step(student, batch_a)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_distill_run_learns_from_the_teacher_and_hard_weight_1_is_the_cross_entropy(tmp_path: Path) -> None:
    teacher = teacher_run(tmp_path / "teacher")
    data = [
        "data=text_files",
        f"data.root={corpus(tmp_path / 'text')}",
        "trainer=smoke",
        "trainer.max_steps=4",
    ]
    common = ["+task=distill", *TINY, *data, f"task.teacher={teacher}"]
    train(tmp_path / "kl", [*common, "task.loss=forward_kl", "optim.lr=1e-2"])
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "kl") if "train/loss" in r]
    assert losses[-1] < losses[0]
    # the student generates as an lm run does (recipes.generate serves distill runs)
    r = run_here(
        "recipes.generate", f"ckpt={tmp_path / 'kl'}", "prompt=the", "max_new_tokens=5", "temperature=0"
    )
    assert r.returncode == 0 and r.stdout.startswith("the"), r.stderr[-2000:]
    train(tmp_path / "hard", [*common, "task.hard_weight=1"])
    rows = [r for r in read_metrics(tmp_path / "hard") if "train/loss" in r]
    assert all(r["train/loss"] == pytest.approx(r["train/ce"], rel=1e-6) for r in rows)


@pytest.mark.slow
def test_a_chat_distill_run_trains_on_the_assistant_tokens(tmp_path: Path) -> None:
    teacher = teacher_run(tmp_path / "teacher")
    conv = {
        "messages": [{"role": "user", "content": "which book?"}, {"role": "assistant", "content": "Genesis"}]
    }
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(conv) for _ in range(20)) + "\n")
    chat = [a for a in TINY if not a.startswith("task.context")] + ["task.context=128"]
    args = [
        "+task=distill",
        *chat,
        "data=chat",
        f"data.train={path}",
        "trainer=smoke",
        f"task.teacher={teacher}",
    ]
    run = train(tmp_path / "run", args)
    assert (run / "model.safetensors").is_file()
    task = Distillation(
        model={"name": "llama", **SIZES},
        data={"name": "chat", "train": str(path)},
        teacher=str(teacher),
        context=128,
    )
    x, y, _ = task.build_datasets()[0][0]
    # the kept targets are the assistant's reply and its end of turn, nothing of the question
    kept = task.tokenizer.decode(y[y != IGNORE].tolist())
    assert kept.startswith("Genesis") and "which" not in kept


@pytest.mark.slow
@pytest.mark.parametrize("teacher", ["online", "stored"])
def test_a_distill_run_killed_with_sigkill_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, teacher: str
) -> None:
    run = teacher_run(tmp_path / "teacher")
    shards = tmp_path / "shards"
    prepare = [
        f"data.root={corpus(tmp_path / 'text')}",
        f"out={shards}",
        "data.val_fraction=0.3",
        "workers=1",
    ]
    prepare += ["progress=false", f"task.context={CONTEXT}"]
    if teacher == "stored":
        prepare += [f"teacher={run}", "teacher_top_k=8"]
    assert run_here("recipes.prepare", "+task=lm", *prepare).returncode == 0
    source = f"task.teacher={run}" if teacher == "online" else f"task.teacher_logprobs={shards / 'teacher'}"
    steps = ["trainer.max_steps=12", "trainer.ckpt_every=2", "trainer.keep_last=20", "trainer.export=last"]
    args = ["+task=distill", *TINY, "data=tokens", f"data.path={shards}", source, *steps]
    killed_and_resumed([sys.executable, "-m", "recipes.train", *args], tmp_path, 4, dist_env_vars())


@pytest.mark.slow
def test_a_teacher_with_non_finite_logits_stops_the_run_as_every_non_finite_loss(tmp_path: Path) -> None:
    from recipes import train as recipe
    from tests.helpers import in_process

    teacher = teacher_run(tmp_path / "teacher", weights={"tok_emb.weight": float("nan")})
    data = ["data=text_files", f"data.root={corpus(tmp_path / 'text')}", "trainer=smoke"]
    run = tmp_path / "run"
    args = ["+task=distill", *TINY, *data, f"task.teacher={teacher}", "trainer.nonfinite=abort"]
    assert in_process(recipe.main, [*args, f"hydra.run.dir={run}"], cwd=tmp_path) == 3  # TrainingError
    assert not (run / "model.safetensors").exists()


def test_micro_batches_weighted_by_their_kept_targets_give_the_whole_batchs_loss(tmp_path: Path) -> None:
    teacher = teacher_run(tmp_path / "teacher")
    task = Distillation(
        model={"name": "llama", **SIZES},
        data={"name": "text_files", "root": str(corpus(tmp_path / "text"))},
        teacher=str(teacher),
        context=CONTEXT,
        hard_weight=0.3,
    )
    train_set, _ = task.build_datasets()
    torch.manual_seed(0)
    student = task.build_model()
    batch = [torch.stack(t) for t in zip(*(train_set[i] for i in range(6)), strict=True)]
    parts = [[t[:1] for t in batch], [t[1:] for t in batch]]  # 1 and 5 rows, not kept alike per row
    units = [task.loss_units(p) for p in parts]
    assert units[0] * 5 != units[1] and sum(units) == int((batch[1] != IGNORE).sum()) < batch[1].numel()
    # the loop's accumulation: each micro-batch's loss weighted by its share of the kept targets
    accumulated = sum(task.step(student, p).loss * n / sum(units) for p, n in zip(parts, units, strict=True))
    torch.testing.assert_close(accumulated, task.step(student, batch).loss, rtol=1e-6, atol=1e-7)
