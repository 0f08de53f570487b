"""bench/kjv_heldout.py: a folder's answers are what +task=grpo's validation scores, summed per book and
said answer, and two models' paired counts and McNemar statistics equal their definitions (scipy's binomial
test); its answers files read back to the same tables; bad arguments are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import kjv_heldout
from core.checkpoint.layout import META
from text.checkpoints.hf import write_folder
from text.grpo import GroupRelativePolicyOptimization
from text.policy_gradient import token_logps
from text.prompts import collate_prompts
from text.rollouts import pack_rollout

TINY_MODEL = {"name": "llama", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64}
COUNT = 300  # 60 verses a book: 42 held out, 6 of them Psalms


def _task(weights: str = "") -> GroupRelativePolicyOptimization:
    model = {"name": "llama", "weights": weights} if weights else dict(TINY_MODEL)
    return GroupRelativePolicyOptimization(
        model=model,
        data={"name": "prompts", "embedded": "kjv", "count": COUNT},
        context=256,
        max_new_tokens=24,
    )


def _taught(path: Path, books: tuple[str, ...], steps: int) -> Path:
    """A tiny llama taught to answer each of `books` to every one of 8 prompts (for speed), saved as a
    Hugging Face folder at `path`."""
    torch.manual_seed(0)
    task = _task()
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:8]  # a constant answer needs few prompts
    answers = [task.tokenizer.encode(book + task.template.end_of_turn()) for book in books]
    tokens, mask = pack_rollout(
        [r.ids for r in rows for _ in answers], answers * len(rows), task.tokenizer.pad_id
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logps = token_logps(model, tokens, 1.0)[0]
        loss = -(logps * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return write_folder(model.eval(), path)


@pytest.fixture(scope="module")
def psalms_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama taught to answer "Psalms" (the loss ends near 0.004 nats a token)."""
    return _taught(tmp_path_factory.mktemp("psalms") / "hf", ("Psalms",), 100)


def test_a_folders_answers_are_its_validation_reward_summed_per_book(
    psalms_folder: Path, tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    try:
        out = kjv_heldout.main(
            [
                f"a={psalms_folder}",
                f"b={psalms_folder}",
                "--count",
                str(COUNT),
                "--precision",
                "fp32",
                "--out",
                str(tmp_path),
                "--threads",
                "1",
            ]  # fmt: skip
        )
    finally:
        torch.set_num_threads(threads)
    task = _task(str(psalms_folder))
    model = task.build_model().eval()
    val = task.build_datasets()[1].rows
    with torch.no_grad():
        reward = task.evaluate(model, [collate_prompts(val)])["reward"]
    a = out["models"]["a"]
    written = json.loads((tmp_path / "a.json").read_text())
    assert [r["prompt"] for r in written] == [r.prompt for r in val]
    assert a["questions"] == len(val) and a["exact_match"] == pytest.approx(reward, abs=1e-12)
    # the model learnt to say Psalms (most answers, some run on past it): right on Psalms verses alone
    assert a["said"]["Psalms"] > len(val) // 2 and a["said"]["Psalms"] + a["said"]["other"] == len(val)
    assert a["right"] == sum(r["ok"] for r in written) == sum(r["said"] == r["answer"] for r in written) > 0
    psalms = [r for r in written if r["answer"] == "Psalms"]
    assert a["recall"]["Psalms"] == sum(r["ok"] for r in psalms) / len(psalms) > 0
    assert all(a["recall"][b] == 0.0 for b in kjv_heldout.BOOKS if b != "Psalms")
    asked = {r["answer"] for r in written}
    assert a["mean_recall"] == pytest.approx(a["recall"]["Psalms"] / len(asked), rel=1e-12)
    # each whole answer's probability: the greedy answer's is the sampler's own (fp32, 1e-5)
    with torch.no_grad():
        greedy = task.sample(model, val, torch.Generator(), group_size=1, temperature=0.0)
    books = [r for r in written if r["said"] in kjv_heldout.BOOKS]
    assert books  # most answers are "Psalms" and its end of turn
    for r, logprobs in zip(written, greedy.logprobs, strict=True):
        assert sum(r["p"].values()) <= 1 + 1e-6
        if r["said"] in kjv_heldout.BOOKS:
            assert r["p"][r["said"]] == pytest.approx(float(logprobs.sum().exp()), abs=1e-5)
    mean = sum(r["p"]["Revelation"] for r in psalms) / len(psalms)
    assert a["p"]["Psalms"]["Revelation"] == pytest.approx(mean, rel=1e-12)
    assert a["p"]["Genesis"]["Psalms"] > 0.5  # the model answers Psalms to Genesis's verses
    expected = sum(r["p"][r["answer"]] for r in written) / len(written)
    assert a["expected_reward"] == pytest.approx(expected, rel=1e-12)
    off = [max(0.0, 1 - sum(r["p"].values())) for r in written]  # a sum past 1 is rounding: none off
    assert a["no_book"] == pytest.approx(sum(off) / len(written), rel=1e-12) and 0 < a["no_book"] < 1
    # a model against itself: no discordant answer
    assert out["pairs"][("a", "b")] == {
        "both": a["right"], "only_a": 0, "only_b": 0, "neither": len(val) - a["right"], "z": 0.0, "p": 1.0,
    }  # fmt: skip
    # the answers files read back to the same tables, without the folder
    again = kjv_heldout.main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}"])
    assert again["models"] == out["models"] and again["pairs"] == out["pairs"]


@pytest.mark.slow  # 40 sampled draws of a taught model (~16 s on 2 loaded cores): a bench's own check
def test_sampled_groups_hold_the_right_answer_as_often_as_the_answers_probabilities_say(
    tmp_path: Path,
) -> None:
    # taught "Psalms" and "Genesis" alike, briefly: each answer near 1/4 on every verse (a group of 2 holds
    # it near 0.4), the others near 0, so the group statistic is far from 0 and 1 and from one sample's
    folder = _taught(tmp_path / "hf", ("Psalms", "Genesis"), 60)
    group, repeats = 2, 40
    out = kjv_heldout.main(
        [f"m={folder}", "--count", str(COUNT), "--precision", "fp32", "--out", str(tmp_path), "--group", "2"]
    )
    m, written = out["models"]["m"], json.loads((tmp_path / "m.json").read_text())
    task = _task(str(folder))
    model = task.build_model().eval()
    val = task.build_datasets()[1].rows
    held = [1 - (1 - r["p"][r["answer"]]) ** group for r in written]
    chance = [r["p"][r["answer"]] for r in written]
    assert m["group_right"]["all"] == pytest.approx(sum(held) / len(val), rel=1e-12)
    assert 0.2 < m["group_right"]["Psalms"] < 0.95 and 0.2 < m["group_right"]["Genesis"] < 0.95
    # sampled at temperature 1 in groups (as +task=grpo draws them): the groups holding a right answer and
    # the right samples are what the whole answers' probabilities say, within 4 standard deviations
    gen, groups, rewarded = torch.Generator().manual_seed(0), 0.0, 0.0
    with torch.no_grad():
        for _ in range(repeats):
            drawn = task.sample(model, val, gen, group_size=group, temperature=1.0, top_p=1.0)
            texts = [task.completion_text(ids) for ids in drawn.ids]
            ok = task.score(val, texts, drawn.ids, group)[:, 0].view(len(val), group)
            groups += float(ok.amax(dim=1).sum())
            rewarded += float(ok.sum())
    assert abs(groups - repeats * sum(held)) <= 4 * (repeats * sum(c * (1 - c) for c in held)) ** 0.5
    spread = (repeats * group * sum(c * (1 - c) for c in chance)) ** 0.5
    assert abs(rewarded - repeats * group * sum(chance)) <= 4 * spread
    assert m["expected_reward"] == pytest.approx(sum(chance) / len(val), rel=1e-12)


@pytest.mark.parametrize(
    ("only_a", "only_b", "both", "neither"), [(66, 38, 200, 239), (13, 19, 5, 0), (0, 3, 1, 1)]
)
def test_paired_counts_and_mcnemar_equal_their_definitions(
    only_a: int, only_b: int, both: int, neither: int
) -> None:
    from scipy.stats import binomtest

    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    p = kjv_heldout.paired(a, b)
    assert (p["both"], p["only_a"], p["only_b"], p["neither"]) == (both, only_a, only_b, neither)
    assert p["z"] == pytest.approx((only_a - only_b) / (only_a + only_b) ** 0.5, abs=1e-12)
    assert p["p"] == pytest.approx(binomtest(only_a, only_a + only_b, 0.5).pvalue, rel=1e-9)


def _answers(tmp_path: Path, name: str, prompts: list[str]) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps([{"prompt": p, "answer": "Psalms", "said": "Psalms", "ok": True} for p in prompts])
    )
    return path


def test_bad_arguments_are_one_line_naming_them_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, other = _answers(tmp_path, "x", ["q1", "q2"]), _answers(tmp_path, "y", ["q1", "q3"])
    (tmp_path / "bad.json").write_text('{"prompt": 1}')
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "short.json").write_text('[{"prompt": "q1", "ok": true}]')
    fake = tmp_path / "fake"  # a folder no model loads from: only checked, never scored, before a bad spec
    fake.mkdir()
    (fake / "config.json").write_text("{}")
    cases = {
        "y": [f"x={first}", f"y={other}"],  # not the same questions
        "nowhere": [f"f={fake}", f"x={first}", f"z={tmp_path / 'nowhere'}"],  # neither a folder nor a file
        "bad.json": [f"x={tmp_path / 'bad.json'}"],  # not an answers file
        "empty.json": [f"x={tmp_path / 'empty.json'}"],  # no answers
        "short.json": [f"x={tmp_path / 'short.json'}"],  # answers without the book and what was said
        "x": [f"x={first}", f"x={first}"],  # a name twice
        "'plain'": ["plain"],  # no NAME=
        "--group": [f"x={first}", "--group", "0"],  # no completions
    }
    for named, argv in cases.items():
        with pytest.raises(SystemExit) as e:
            kjv_heldout.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0]


def test_the_answer_gradients_are_autograds_of_the_expected_reward_and_the_log_likelihood() -> None:
    torch.manual_seed(0)
    probs = torch.rand(12, len(kjv_heldout.BOOKS), dtype=torch.float64) * 0.2  # rows not summing to 1
    right = torch.arange(12) % len(kjv_heldout.BOOKS)
    res = [
        {"answer": kjv_heldout.BOOKS[int(k)], "p": dict(zip(kjv_heldout.BOOKS, row.tolist(), strict=True))}
        for row, k in zip(probs, right, strict=True)
    ]
    logits = probs.log().requires_grad_()
    q = logits.softmax(dim=-1)  # the five answers renormalised
    reward = q.gather(1, right[:, None]).sum()  # expected 0/1 reward of one sample, summed over questions
    likelihood = q.log().gather(1, right[:, None]).sum()
    got = kjv_heldout.answer_gradients(res)
    for key, objective in (("reward_gradient", reward), ("likelihood_gradient", likelihood)):
        (grad,) = torch.autograd.grad(objective, logits, retain_graph=True)
        for j, book in enumerate(kjv_heldout.BOOKS):
            assert got[key][book] == pytest.approx(float(grad[:, j].sum()), abs=1e-12)


def _run_export(root: Path, exported: str, steps: list[int], weights: str) -> Path:
    """A run directory as recipes.train and recipes.export leave it: RUN/export/hf, export.json, result.json
    and the checkpoints' directories (files only; no weights)."""
    run = root / "runs" / "r"
    hf = run / "export" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (run / "export" / "export.json").write_text(json.dumps({"hf": {"weights": weights}}))
    (run / "result.json").write_text(json.dumps({"exported": str(run / "checkpoints" / exported)}))
    for s in steps:  # a complete checkpoint is a step directory with its meta file
        (run / "checkpoints" / f"step_{s:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{s:08d}" / META).write_text("{}")
    return hf


def test_a_runs_own_export_of_a_best_but_not_last_checkpoint_is_named(tmp_path: Path) -> None:
    hf = _run_export(tmp_path / "a", "step_00000100", [100, 200], "runs/r/model.safetensors")
    assert kjv_heldout.best_not_last(hf) == ("step_00000100", "step_00000200")
    # the best is the last; exported from a checkpoint; a folder without its run: nothing to say
    assert (
        kjv_heldout.best_not_last(
            _run_export(tmp_path / "b", "step_00000200", [100, 200], "m/model.safetensors")
        )
        is None
    )
    assert (
        kjv_heldout.best_not_last(
            _run_export(tmp_path / "c", "step_00000100", [100, 200], "runs/r/checkpoints/step_00000200")
        )
        is None
    )
    lone = tmp_path / "lone"
    lone.mkdir()
    assert kjv_heldout.best_not_last(lone) is None
