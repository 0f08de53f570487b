"""Preference tuning (`+task=dpo`, text/preference.py and text/dpo.py): the loss, rewards and every gradient
equal TRL's own trainers' (DPOTrainer for sigmoid and ipo, CPOTrainer for simpo; the test-only `hf` extra)
on a tiny random Qwen2 model in float64 to 1e-6; at step 0 the policy is the reference and the sigmoid loss
is ln 2; conversational pairs tokenize as +task=sft tokenizes the conversation; bad pairs are one line naming
file:line and the key (exit 2, before training); micro-batches accumulate to one batch of pairs; the
precomputed reference is the live one and a resume reads it back; a LoRA run's reference is its base and its
peft export loads in peft with our logits."""

from __future__ import annotations

import collections
import copy
import json
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError, DataError
from tests.helpers import read_metrics, run_here, train
from text.chat import CHATML, ChatTemplate, encode_conversation, prompt_ids
from text.dpo import REFERENCE_FILE, PreferenceTuning, completion_logps, first_scored, scored_logps
from text.lm_data import IGNORE
from text.preference import PreferencePair, PreferencePairs, collate_pairs, encode_pair, read_pairs
from text.preference_losses import LOSSES, pair_losses
from text.tokenizer import ByteTokenizer

SIZES = ["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.hidden=64"]


def _chats(n: int) -> list[dict[str, Any]]:
    """`n` conversational pairs whose answers differ in length."""
    return [
        {
            "prompt": [{"role": "user", "content": f"Say {i}"}],
            "chosen": [{"role": "assistant", "content": "yes " * (1 + i % 3)}],
            "rejected": [{"role": "assistant", "content": f"no {i}"}],
        }
        for i in range(n)
    ]


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 conversational pairs."""
    return _write(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", _chats(24))


def _run_args(data: Path, *extra: str) -> list[str]:
    """A tiny +task=dpo run of `data` (fp32, bytes), `extra` overriding its keys."""
    base = [
        "+task=dpo",
        "model=llama",
        *SIZES,
        "trainer=smoke",
        "trainer.batch_size=4",
        "task.context=96",
        "task.eval_questions=0",
        "logger=none",
        "precision=fp32",
        "compile.policy=off",
        f"data.train={data}",
    ]
    given = {e.split("=")[0] for e in extra}
    return [a for a in base if a.split("=")[0] not in given] + list(extra)


# ---- data ------------------------------------------------------------------------------------------------
def test_a_conversational_pair_tokenizes_as_sft_tokenizes_the_conversation() -> None:
    template, tok = ChatTemplate(CHATML), ByteTokenizer()
    row = _chats(2)[1]
    pair = PreferencePair(row["prompt"], row["chosen"], row["rejected"])
    head, chosen, rejected = encode_pair(pair, template, tok)
    assert head == prompt_ids(row["prompt"], template, tok)
    for answer, ids in ((row["chosen"], chosen), (row["rejected"], rejected)):
        whole, mask = encode_conversation([*row["prompt"], *answer], template, tok)
        assert whole == head + ids and mask == [False] * len(head) + [True] * len(ids)
    # the text form: the prompt starts a document, each completion ends it (TRL adds EOS the same way)
    head, chosen, _ = encode_pair(PreferencePair("Q: ", "A", "B"), template, tok)
    assert head == [tok.doc_start_id, *tok.encode("Q: ")] and chosen == [*tok.encode("A"), tok.eos_id]
    # rows: the loss on the completion alone; chosen rows first, then rejected, padded on the right
    ds = PreferencePairs([([9, 1, 2], [3, 4], [5]), ([9, 6], [7, 8, 7], [8, 8])], context=8, offset=10)
    tokens, targets, index = collate_pairs([ds[0], ds[1]], pad_id=0)
    assert tokens.tolist() == [[9, 1, 2, 3], [9, 6, 7, 8], [9, 1, 2, 0], [9, 6, 8, 0]]
    assert targets.tolist() == [
        [IGNORE, IGNORE, 3, 4],
        [IGNORE, 7, 8, 7],
        [IGNORE, IGNORE, 5, IGNORE],
        [IGNORE, 8, 8, IGNORE],
    ]
    assert index.tolist() == [10, 11]


BAD = {
    "equal": ({"prompt": "q", "chosen": "a", "rejected": "a"}, "'rejected'"),
    "empty": ({"prompt": "q", "chosen": "", "rejected": "b"}, "'chosen'"),
    "missing": ({"prompt": "q", "chosen": "a"}, "'rejected'"),
    "not_assistant": (
        {
            "prompt": [{"role": "user", "content": "q"}],
            "chosen": [{"role": "user", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        },
        "'chosen'",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_pair_is_named_by_file_line_and_key(case: str, tmp_path: Path) -> None:
    from core.data.bad_samples import BadSamplePolicy

    row, key = BAD[case]
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError) as e:
        read_pairs(path, BadSamplePolicy(on_bad_sample="error"))
    assert (e.value.key, e.value.value) == ("sample", f"{path}:2")  # data.on_bad_sample=error: the first one
    assert key in str(e.value)
    with pytest.raises(DataError) as e:  # the default: skip at most 1%, and 1 of 2 is more
        read_pairs(path)
    assert (e.value.key, e.value.value) == ("data.max_bad_fraction", "1/2")


def test_a_bad_pair_stops_the_recipe_before_training(pairs_file: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    rows[5]["rejected"] = rows[5]["chosen"]
    path = _write(tmp_path / "pairs.jsonl", rows)
    r = run_here("recipes.train", *_run_args(path), f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert f"{path}:6" in line and "'rejected'" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
    # data.on_bad_sample=skip leaves it out (23 of 24 kept, within max_bad_fraction=0.05)
    from core.data.bad_samples import BadSamplePolicy

    assert len(read_pairs(path, BadSamplePolicy("skip", 0.05))) == 23


def test_the_frozen_reference_is_the_model_as_built_rebuilt_without_drawing_randoms(pairs_file: Path) -> None:
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    task = PreferenceTuning(
        model=model_cfg, data={"name": "preference", "train": str(pairs_file)}, context=96
    )
    torch.manual_seed(0)
    model = task.build_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():  # training moves the model; the reference stays where it started
            p.add_(1.0)
    state = torch.get_rng_state()
    reference = task._frozen_reference(model)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream untouched (resume stays exact)
    assert all(torch.equal(reference.state_dict()[k], v) for k, v in initial.items())
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())


def test_label_smoothing_under_ipo_is_a_config_error_naming_it() -> None:
    from core.errors import ConfigError
    from tests.helpers import fault

    with pytest.raises(ConfigError) as e:
        PreferenceTuning(
            model={"name": "llama"}, data={"name": "preference"}, loss="ipo", label_smoothing=0.1
        )
    assert fault(e.value) == ("task.label_smoothing", "0.1", ("0",))


def test_rejected_model_takes_the_models_own_wrong_answers(tmp_path: Path) -> None:
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    data = {"name": "preference", "train": str(_write(tmp_path / "pairs.jsonl", _chats(5)))}
    task = PreferenceTuning(model=model_cfg, data=data, context=96, rejected="model")
    torch.manual_seed(0)
    reference = task.build_model()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # far from its init: a random init answers newlines alone, which strip to nothing
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    task.initial = reference  # (the model as built, which answers)
    train_ds, val_ds = task.build_datasets()
    assert task.initial is None  # the copy that answered is not kept
    tok, replaced = task.tokenizer, 0
    for pair, (head, _, rejected) in zip(task.corpus.train, train_ds.pairs, strict=True):
        want = pair.chosen[-1]["content"].strip()
        said = task.greedy_answer(reference, pair.prompt, want)
        if said and said != want:  # the model's own wrong answer; else the pair's own rejected one
            pair = PreferencePair(pair.prompt, pair.chosen, [{"role": "assistant", "content": said}])
            replaced += 1
        assert (head, rejected) == encode_pair(pair, task.template, tok)[::2]
    assert replaced > 0
    # validation keeps the data's own pairs, so its rewards compare across runs
    assert val_ds.pairs == [encode_pair(p, task.template, tok) for p in task.corpus.val]


def test_the_validation_pairs_alone_are_built_without_the_models_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # recipes.eval and recipes.export read the validation split alone: building the training pairs'
    # model answers for them cost a greedy answer to every training prompt (408 s for 4,885 on the KJV run)
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    data = {"name": "preference", "train": str(_write(tmp_path / "pairs.jsonl", _chats(12)))}
    task = PreferenceTuning(model=model_cfg, data=data, context=96, rejected="model")
    whole = task.build_datasets()[1]
    calls: list[int] = []
    monkeypatch.setattr(task, "greedy_answer", lambda *a, **k: calls.append(1))
    alone = task.build_val_dataset()
    assert not calls
    assert len(alone) == len(whole) > 0 and alone.pairs == whole.pairs
    for i in range(len(whole)):  # the same items, numbered after the training pairs as before
        for mine, theirs in zip(alone[i], whole[i], strict=True):
            assert torch.equal(torch.as_tensor(mine), torch.as_tensor(theirs))


# ---- against TRL -----------------------------------------------------------------------------------------
def _tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, Path]:
    """A random Qwen2 policy and a reference a little away from it, each saved as a folder."""
    from tests.text.test_hf_llama import reference

    policy = reference("qwen2_tied", seed=0)
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    folders = tmp_path_factory.mktemp("policy"), tmp_path_factory.mktemp("reference")
    policy.save_pretrained(folders[0])
    ref.save_pretrained(folders[1])
    return policy.double(), ref.double(), *folders


def _batch() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Three pairs of prompts and completions of different lengths, right-padded: TRL's inputs (input_ids,
    attention_mask, completion_mask) and ours (tokens, targets, index)."""
    g = torch.Generator().manual_seed(2)
    shapes = [(4, 3, 5), (2, 6, 1), (5, 2, 4)]  # prompt, chosen, rejected lengths
    rows, masks = [], []
    for side in (1, 2):
        for shape in shapes:
            prompt = torch.randint(3, 300, (shape[0],), generator=g)
            g_side = torch.Generator().manual_seed(int(prompt.sum()) + side)
            rows.append(torch.cat([prompt, torch.randint(3, 300, (shape[side],), generator=g_side)]))
            masks.append([0] * shape[0] + [1] * shape[side])
    # the same prompt for both completions of a pair
    for j in range(3):
        rows[3 + j][: shapes[j][0]] = rows[j][: shapes[j][0]]
    length = max(len(r) for r in rows)
    ids = torch.zeros(6, length, dtype=torch.long)
    attention = torch.zeros(6, length, dtype=torch.long)
    completion = torch.zeros(6, length, dtype=torch.long)
    for j, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[j, : len(r)], attention[j, : len(r)], completion[j, : len(r)] = r, 1, torch.tensor(m)
    targets = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE)
    theirs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    return theirs, (ids[:, :-1], targets, torch.arange(3))


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TRL's DPOTrainer and CPOTrainer on the tiny policy (float64, CPU), and the folders."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    trl = pytest.importorskip("trl", reason="trl (the `hf` extra) is not installed")
    import datasets
    import tokenizers
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, ref, policy_dir, ref_dir = _tiny_folders(tmp_path_factory)
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t2")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="t1", pad_token="t0", unk_token="t2"
    )
    rows = datasets.Dataset.from_list([{"prompt": "t5 t6", "chosen": " t7", "rejected": " t8"}] * 2)
    out = tmp_path_factory.mktemp("trl")
    common = {"output_dir": str(out), "report_to": [], "use_cpu": True, "bf16": False, "save_strategy": "no"}
    # copied before DPOTrainer patches the policy's forward (a closure over the policy a copy would share)
    cpo_policy, wpo_policy = copy.deepcopy(policy), copy.deepcopy(policy)
    dpo = trl.DPOTrainer(
        model=policy,
        ref_model=ref,
        args=trl.DPOConfig(**common, loss_type=["sigmoid"]),
        train_dataset=rows,
        processing_class=tok,
    )
    # WPO's weights need the fused head's log sum p^2, which TRL asks of it when built with use_weighting
    wpo = trl.DPOTrainer(
        model=wpo_policy,
        ref_model=copy.deepcopy(ref),
        args=trl.DPOConfig(**common, loss_type=["sigmoid"], use_weighting=True),
        train_dataset=rows,
        processing_class=tok,
    )
    cpo = CPOTrainer(
        model=cpo_policy,
        args=CPOConfig(**common, loss_type="simpo", max_length=64),
        train_dataset=rows,
        processing_class=tok,
    )
    return {"dpo": dpo, "wpo": wpo, "cpo": cpo, "policy": policy_dir, "reference": ref_dir}


def _theirs(
    setup: dict[str, Any],
    loss: str | list[str],
    beta: float,
    sft_weight: float,
    smoothing: float,
    more: dict[str, Any] | None = None,
) -> Any:
    """TRL's (loss, chosen reward, rejected reward, model) on `_batch()`, computed by its trainer; `more`:
    loss_weights, f_divergence_type, f_alpha_divergence_coef, discopop_tau as its config's."""
    more = more or {}
    inputs, _ = _batch()
    if loss == "simpo":
        cpo = setup["cpo"]
        cpo.beta, cpo.simpo_gamma, cpo.cpo_alpha, cpo.label_smoothing = beta, 0.3, sft_weight, smoothing
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        batch = {}
        for side, rows in (("chosen", slice(0, 3)), ("rejected", slice(3, 6))):
            batch[f"{side}_input_ids"] = inputs["input_ids"][rows]
            batch[f"{side}_attention_mask"] = inputs["attention_mask"][rows]
            batch[f"{side}_labels"] = labels[rows]
        value, metrics = cpo.get_batch_loss_metrics(cpo.model, batch)
        return value, metrics["rewards/chosen"], metrics["rewards/rejected"], cpo.model
    dpo = setup["wpo" if more.get("use_weighting") else "dpo"]
    dpo.beta, dpo.label_smoothing, dpo.ld_alpha = beta, smoothing, more.get("ld_alpha")
    losses = [loss] if isinstance(loss, str) else list(loss)
    weights = list(more.get("loss_weights") or [1.0] * len(losses))
    dpo.loss_types, dpo.loss_weights = (
        losses + ["sft"] * bool(sft_weight),
        weights + [sft_weight] * bool(sft_weight),
    )
    dpo.f_divergence_type = more.get("f_divergence_type", "reverse_kl")
    dpo.f_alpha_divergence_coef = more.get("f_alpha_divergence_coef", 0.5)
    dpo.args.discopop_tau = more.get("discopop_tau", 0.05)
    dpo.model.train()  # (no dropout in the model) its metrics are kept under "train"
    dpo._metrics["train"].clear()
    value = dpo._compute_loss(dpo.model, inputs, False)
    metrics = dpo._metrics["train"]
    return value, metrics["rewards/chosen"][-1], metrics["rewards/rejected"][-1], dpo.model


# beta 0.5 for IPO: its loss (margin - 1/(2 beta))^2 scales every gradient by 2 |margin - 1/(2 beta)|, ~10 at
# beta 0.1, which lifts the float32 steps both models keep in float64 (RMSNorm's statistics, the rotary
# angles: their logits agree to 2.5e-7 here) past 1e-6 (1.3e-6 measured); the loss's own math is float64
CASES = {
    "sigmoid": ("sigmoid", 0.1, 0.0, 0.0),
    "sigmoid_sft": ("sigmoid", 0.5, 0.7, 0.0),
    "ipo": ("ipo", 0.5, 0.0, 0.0),
    "simpo": ("simpo", 2.0, 0.0, 0.0),
    "simpo_sft_smoothed": ("simpo", 2.0, 1.0, 0.1),
    # through the task and both models, a few of TRL's other loss types (every one is checked against TRL's
    # loss code in float64 below: TRL's fused head sums float32 log-probs, 2e-6 apart on a completion's ~-20,
    # which sppo_hard's unscaled squares carry past 1e-6)
    "aot": ("aot", 0.5, 0.0, 0.1),
    "robust": ("robust", 0.5, 0.0, 0.2),
    # MPO's mix, the sft term in the list as TRL writes it
    "mpo": (["sigmoid", "bco_pair", "sft"], 0.5, 0.0, 0.0, {"loss_weights": [0.8, 0.2, 1.0]}),
    # LD-DPO (the tokens past the shorter completion weighed, the reference's too) and WPO's pair weights
    "ld_alpha": ("sigmoid", 0.5, 0.0, 0.0, {"ld_alpha": 0.5}),
    "ld_alpha_0_ipo": ("ipo", 0.5, 0.0, 0.0, {"ld_alpha": 0.0}),
    "wpo": ("sigmoid", 0.5, 0.0, 0.0, {"use_weighting": True}),
    # (TRL 1.16 raises on WPO with its sft or hinge loss: an in-place product on an expanded tensor, or on
    # relu's output, which its gradient reads)
    "wpo_ld": ("bco_pair", 0.5, 0.0, 0.0, {"use_weighting": True, "ld_alpha": 0.3}),
    # f-DPO: each log-ratio through another f-divergence's derivative (forward_kl's exp(-ratio) carries the
    # float32 head's error past 1e-6 in the gradient: checked in float64 below)
    "js_divergence": ("sigmoid", 0.5, 0.0, 0.0, {"f_divergence_type": "js_divergence"}),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_rewards_and_every_gradient_equal_trls(case: str, trl_setup: dict[str, Any]) -> None:
    from tests.text.test_hf_llama import ours
    from text.checkpoints.hf import expected_tensors

    loss, beta, sft_weight, smoothing, *rest = CASES[case]
    more = rest[0] if rest else {}
    value, chosen, rejected, hf_model = _theirs(trl_setup, loss, beta, sft_weight, smoothing, more)
    value.backward()
    task = PreferenceTuning(
        model={"name": "llama"},
        data={"name": "preference"},
        loss=loss,
        beta=beta,
        simpo_gamma=0.3,
        sft_weight=sft_weight,
        label_smoothing=smoothing,
        **more,
    )
    task.initial = ours(trl_setup["reference"])  # the reference, as build_model keeps it (moved to float64)
    model = ours(trl_setup["policy"]).double().train()
    out = task.step(model, _batch()[1])
    out.loss.backward()
    assert out.loss.dtype == torch.float64 and abs(float(out.loss) - float(value)) < 1e-6
    assert abs(float(out.metrics["rewards/chosen"]) - chosen) < 1e-6
    assert abs(float(out.metrics["rewards/rejected"]) - rejected) < 1e-6
    assert abs(chosen - rejected) > 1e-3  # policy and reference differ: the rewards are a real test
    grads = 0
    for name, p in expected_tensors(model).items():
        want = hf_model.get_parameter(name).grad
        assert want is not None and want.abs().max() > 0
        # rtol as well: the float32 steps' error grows with the gradient (IPO's, up to 1.7 here: 1.07e-6
        # apart on a Xeon with AMX, 6.4e-7 of it; under 1e-6 on Zen 4)
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-6)
        grads += 1
    assert grads == len(list(model.parameters()))
    hf_model.zero_grad(set_to_none=True)


class _Accelerator:
    """What TRL's DPO loss code asks of accelerate in one process."""

    device = torch.device("cpu")

    def gather_for_metrics(self, x: Any) -> torch.Tensor:
        return x if torch.is_tensor(x) else torch.tensor(x)

    gather = gather_for_metrics


def _trl_pair_loss(
    per_token: torch.Tensor, mask: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], **attrs: Any
) -> torch.Tensor:
    """TRL's `DPOTrainer._compute_loss` (a minimally built trainer) with the policy's per-token log-probs
    `per_token` (2B, L) on the completion tokens of `mask` and the reference's summed ones `ref` given."""
    trl = pytest.importorskip("trl", reason="trl (the `hf` extra) is not installed")
    t = object.__new__(trl.DPOTrainer)
    t.__dict__.update(
        accelerator=_Accelerator(),
        model=types.SimpleNamespace(training=True),
        _metrics={"train": collections.defaultdict(list)},
        precompute_ref_logps=True,
        ld_alpha=None,
        use_weighting=False,
        aux_loss_enabled=False,
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(discopop_tau=attrs.pop("discopop_tau", 0.05)),
        **{
            "label_smoothing": 0.0,
            "f_divergence_type": "reverse_kl",
            "f_alpha_divergence_coef": 0.5,
            **attrs,
        },
    )
    b, n = per_token.shape
    zeros = torch.zeros(b, n)
    outputs = types.SimpleNamespace(
        log_probs=per_token * mask, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )
    inputs = {
        "input_ids": torch.zeros(b, n + 1, dtype=torch.long),
        "attention_mask": torch.ones(b, n + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(b, 1), mask], 1).long(),
        "ref_chosen_logps": ref[0],
        "ref_rejected_logps": ref[1],
    }
    return t._compute_loss(lambda **_: outputs, inputs, False)


#: TRL's DPO loss types (and f-DPO's divergences) against `pair_losses`: (losses, weights, beta, label
#: smoothing, more of TRL's settings)
PAIR_CASES = {
    **{k: ([k], [1.0], 0.5, 0.0, {}) for k in LOSSES if k not in ("simpo", "sft", "exo_pair", "robust")},
    "exo_pair": (["exo_pair"], [1.0], 0.5, 1e-3, {}),
    "robust": (["robust"], [1.0], 0.5, 0.2, {}),
    "aot_smoothed": (["aot"], [1.0], 0.5, 0.1, {}),
    "discopop_tau": (["discopop"], [1.0], 0.5, 0.0, {"discopop_tau": 0.2}),
    "mix": (["sigmoid", "bco_pair", "hinge"], [0.8, 0.2, 0.5], 0.3, 0.0, {}),
    **{
        f"{d}_{k}": ([k], [1.0], 0.5, 1e-3 if k == "exo_pair" else 0.0, {"f_divergence_type": d})
        for d in ("forward_kl", "js_divergence")
        for k in ("sigmoid", "ipo", "hinge", "exo_pair", "discopop", "sigmoid_norm")
    },
}


@pytest.mark.parametrize("case", PAIR_CASES)
def test_every_pair_loss_and_its_gradient_equal_trls_loss_code_in_float64(case: str) -> None:
    losses, weights, beta, smoothing, more = PAIR_CASES[case]
    g = torch.Generator().manual_seed(7)
    per_token = torch.randn(6, 5, dtype=torch.float64, generator=g) * 0.3 - 1  # 3 pairs, chosen then rejected
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1  # every completion has a token
    ref = tuple(per_token.detach().mul(mask).sum(1).view(2, 3) + 0.4 * torch.randn(2, 3, dtype=torch.float64))
    theirs_in, ours_in = per_token.clone().requires_grad_(True), per_token.clone().requires_grad_(True)
    attrs = {"beta": beta, "loss_types": losses, "loss_weights": weights, "label_smoothing": smoothing}
    theirs = _trl_pair_loss(theirs_in, mask, ref, **attrs, **more)
    summed, counts = (ours_in * mask).sum(1), mask.sum(1)
    ours = sum(
        w
        * pair_losses(
            k,
            (summed[:3], summed[3:]),
            ref,
            (counts[:3], counts[3:]),
            beta=beta,
            label_smoothing=smoothing,
            divergence=more.get("f_divergence_type", "reverse_kl"),
            discopop_tau=more.get("discopop_tau", 0.05),
        ).mean()
        for k, w in zip(losses, weights, strict=True)
    )
    assert isinstance(ours, torch.Tensor)
    theirs.backward()
    ours.backward()
    # exo_pair's epsilon is a float32 tensor in TRL's code (log1p(-eps), log(eps): 5e-8 apart)
    tol = 1e-7 if "exo_pair" in losses else 1e-12
    assert abs(float(ours) - float(theirs)) < tol
    assert theirs_in.grad is not None and ours_in.grad is not None and ours_in.grad.abs().max() > 0
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=0, atol=tol)


def test_the_alpha_divergence_equals_trls_in_float32() -> None:
    # TRL's alpha-divergence casts through float32 (its exponent's cap is per float type, float64 has none)
    g = torch.Generator().manual_seed(8)
    per_token = torch.randn(6, 5, generator=g) * 0.3 - 1
    mask = torch.ones(6, 5)
    ref = tuple(per_token.sum(1).view(2, 3) + 0.4 * torch.randn(2, 3, generator=g))
    for alpha in (0.3, 1.0, 2.5):
        attrs = {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": alpha}
        theirs = _trl_pair_loss(
            per_token, mask, ref, beta=0.5, loss_types=["ipo"], loss_weights=[1.0], **attrs
        )
        summed = per_token.sum(1)
        ours = pair_losses(
            "ipo",
            (summed[:3], summed[3:]),
            ref,
            (mask[:3].sum(1), mask[3:].sum(1)),
            beta=0.5,
            divergence="alpha_divergence",
            alpha=alpha,
        ).mean()
        assert abs(float(ours) - float(theirs)) < 1e-6


def test_losses_trl_refuses_together_are_one_line_naming_the_key() -> None:
    def refused(**options: Any) -> tuple[str, str]:
        with pytest.raises(ConfigError) as e:
            PreferenceTuning(model={"name": "llama"}, data={"name": "preference"}, **options)
        return e.value.key, e.value.value

    assert refused(loss="exo_pair") == ("task.label_smoothing", "0")
    assert refused(loss=["simpo", "sigmoid"]) == ("task.loss", "simpo,sigmoid")
    assert refused(loss="ipo", label_smoothing=0.1) == ("task.label_smoothing", "0.1")
    assert refused(loss=["sigmoid", "hinge"], loss_weights=[1.0]) == ("task.loss_weights", "[1.0]")
    assert refused(loss="bco_pair", f_divergence_type="forward_kl") == (
        "task.f_divergence_type",
        "forward_kl",
    )
    assert refused(loss="aot", use_weighting=True) == ("task.use_weighting", "true")
    assert refused(loss="simpo", ld_alpha=0.0) == ("task.ld_alpha", "0.0")


@pytest.mark.parametrize("name", ["gpt", "llama", "qwen3_moe"])
def test_the_head_run_from_the_first_completion_token_gives_the_full_forwards_log_probs(name: str) -> None:
    from core.registry import MODELS

    sizes = {"n_layer": 2, "d_model": 32, "n_head": 4}
    if name != "gpt":
        sizes |= {"n_kv_head": 2, "hidden": 64} | ({"expert_hidden": 32} if name == "qwen3_moe" else {})
    torch.manual_seed(0)
    model = MODELS.build(name, vocab_size=300, context=64, **sizes).double()
    tokens, targets, _ = _batch()[1]
    # the shortest prompt is 2 ids: its second predicts the first completion token, at position 1
    assert first_scored(targets) == 1
    full = model(tokens)
    torch.testing.assert_close(model(tokens, logits_to_keep=5), full[:, -5:], atol=1e-12, rtol=0)
    want = completion_logps(full, targets)
    assert torch.all(want[:, :1] == 0)  # position 0 scores nothing in any row
    torch.testing.assert_close(scored_logps(model, tokens, targets), want[:, 1:], atol=1e-12, rtol=0)


# ---- through the recipe ----------------------------------------------------------------------------------
def test_step_0_is_ln_2_and_the_run_logs_the_rewards(pairs_file: Path, tmp_path: Path) -> None:
    run = train(tmp_path / "run", _run_args(pairs_file, "trainer.max_steps=3", "task.eval_questions=1"))
    rows = read_metrics(run)
    first = next(r for r in rows if r["step"] == 0)
    step1 = next(r for r in rows if r["step"] == 1 and "train/loss" in r)
    # the policy is its reference before the first update: every log-ratio is 0
    assert first["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step1["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    keys = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
    last = [r for r in rows if "val/loss" in r][-1]
    assert all(f"train/{k}" in step1 and f"val/{k}" in last for k in keys)
    assert last["val/rewards/margin"] == pytest.approx(
        last["val/rewards/chosen"] - last["val/rewards/rejected"], abs=1e-6
    )
    assert "val/exact_match" in last and last["val/rewards/margin"] != 0
    # recipes.generate answers as the chat fine-tune does: the prompt as one user message, the reply alone
    asked = ["prompt=Say 3", "temperature=0", "max_new_tokens=4"]
    r = run_here("recipes.generate", f"ckpt={run}", *asked)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not r.stdout.startswith("Say 3")


def test_micro_batches_of_pairs_accumulate_to_one_batch(pairs_file: Path) -> None:
    from tests.core.accumulation_reference import accumulated_grads, max_deviation, one_batch_grads

    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    data = {"name": "preference", "train": str(pairs_file)}
    task = PreferenceTuning(model=model_cfg, data=data, context=96, sft_weight=0.0)
    train_ds, _ = task.build_datasets()
    torch.manual_seed(0)
    model = task.build_model().double()
    with torch.no_grad():  # the policy away from its reference, so the loss has a gradient of its own
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    collate = task.collate_fn()
    items = [train_ds[i] for i in range(8)]

    def ready(m: torch.nn.Module, b: Any) -> Any:
        return b

    want = one_batch_grads(task, model, collate(items), ready)
    micro = [collate(items[i : i + 1]) for i in range(8)]
    assert [task.loss_units(b) for b in micro] == [1] * 8
    assert max_deviation(accumulated_grads(task, model, micro, ready), want) < 1e-10  # float64


def test_ld_dpos_precomputed_reference_is_the_live_one_and_its_fingerprint_names_alpha(
    pairs_file: Path,
) -> None:
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    data = {"name": "preference", "train": str(pairs_file)}
    tasks = [PreferenceTuning(model=model_cfg, data=data, context=96, ld_alpha=a) for a in (0.25, None)]
    for t in tasks:
        t.build_datasets()
    torch.manual_seed(0)
    model = tasks[0].build_model()
    tasks[1].build_rng = tasks[0].build_rng  # both references are this model as built
    cached = tasks[0]._compute_reference(model)  # (pairs, 2), as task.precompute_reference stores them
    batch = tasks[0].collate_fn()([tasks[0].datasets[0][i] for i in range(4)])  # type: ignore[index]
    live = tasks[0].reference_forward(model, batch[0], batch[1])
    torch.testing.assert_close(torch.cat([cached[:4, 0], cached[:4, 1]]), live.double(), rtol=0, atol=1e-6)
    plain = tasks[1].reference_forward(model, batch[0], batch[1])
    assert not torch.allclose(live, plain)  # the pairs' completions differ in length: the tails weigh less
    # a cache computed at another ld_alpha is computed again, not read
    assert tasks[0]._fingerprint(model, "fp32") != tasks[1]._fingerprint(model, "fp32")


def test_syncing_the_reference_mixes_the_policy_in_as_trls_callback_and_a_resume_restores_it(
    pairs_file: Path,
) -> None:
    callbacks = pytest.importorskip("trl.trainer.callbacks", reason="trl (the `hf` extra) is not installed")
    model_cfg = {"name": "llama", "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "hidden": 64}
    data = {"name": "preference", "train": str(pairs_file)}
    options = {"sync_ref_model": True, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 2}
    task = PreferenceTuning(model=model_cfg, data=data, context=96, **options)
    sync = task.reference_sync
    assert sync is not None and sync in task.callbacks()
    torch.manual_seed(0)
    model = task.build_model()
    theirs = copy.deepcopy(task._frozen_reference(model))  # the model as built
    with torch.no_grad():  # as training would have moved it
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    trainer = types.SimpleNamespace(model=model, state=types.SimpleNamespace(step=1))
    sync.on_step_end(trainer, {})  # not a sync step
    assert sync.state_dict() == {}
    trainer.state.step = 2
    sync.on_step_end(trainer, {})
    callbacks.SyncRefModelCallback._sync_target_model(model, theirs, 0.6)
    synced = dict(task._frozen_reference(model).named_parameters())
    assert all(torch.equal(synced[k], v) for k, v in theirs.named_parameters())
    again = PreferenceTuning(model=model_cfg, data=data, context=96, **options)
    again.build_rng = task.build_rng  # the same model as built: its reference before any sync
    assert again.reference_sync is not None
    again.reference_sync.load_state_dict(sync.state_dict())
    restored = dict(again._frozen_reference(model).named_parameters())
    assert all(torch.equal(restored[k], v) for k, v in synced.items())
    for refused in ({"precompute_reference": True}, {"loss": "simpo"}):
        with pytest.raises(ConfigError) as e:
            PreferenceTuning(model=model_cfg, data=data, context=96, **options, **refused)
        assert (e.value.key, e.value.value) == ("task.sync_ref_model", "true")


@pytest.mark.slow  # two short runs (~20 s)
def test_a_run_syncing_its_reference_resumes_bit_exact(pairs_file: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file

    steps = ["trainer.max_steps=3", "trainer.ckpt_every=1", "trainer.keep_last=5"]
    args = _run_args(pairs_file, *steps, "task.sync_ref_model=true", "task.ref_model_sync_steps=1")
    whole = train(tmp_path / "whole", args)
    state = torch.load(whole / "checkpoints" / "step_00000001" / "train.pt", weights_only=True)
    assert "reference" in state["callbacks"]["ReferenceSync"]  # synced at step 1: its weights kept
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("step_0000000[23]", "model.safetensors"))
    train(resumed, [*args, "resume=auto"])
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a run and its evaluation: ~15 s
def test_recipes_eval_of_a_random_init_run_gives_its_last_rewards(pairs_file: Path, tmp_path: Path) -> None:
    # no model.weights: the reference is built again from the random state the run's model started from
    run = train(tmp_path / "run", _run_args(pairs_file, "trainer.max_steps=3"))
    out = tmp_path / "eval.json"
    r = run_here("recipes.eval", f"ckpt={run}", "device=cpu", "precision=fp32", f"out={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())["metrics"]
    want = [row for row in read_metrics(run) if "val/loss" in row][-1]
    assert want["val/rewards/margin"] != 0
    for key in ("val/loss", "val/rewards/chosen", "val/rewards/rejected", "val/rewards/margin"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key


@pytest.mark.slow  # two runs: ~10 s
def test_the_trainer_accumulating_1x8_pairs_takes_the_step_of_one_batch_of_8(
    pairs_file: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    one = [
        "trainer.max_steps=1",
        "optim.name=sgd",
        "optim.lr=1.0",
        "optim.warmup_steps=0",
        "trainer.grad_clip=0",
    ]
    a = train(tmp_path / "a", _run_args(pairs_file, *one, "trainer.batch_size=8"))
    b = train(tmp_path / "b", _run_args(pairs_file, *one, "trainer.batch_size=1", "trainer.grad_accum=8"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6  # fp32: the same 8 pairs, one step


@pytest.mark.slow  # three runs: ~15 s
def test_the_precomputed_reference_is_the_live_one_and_a_resume_reads_it_back(
    pairs_file: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    steps = ["trainer.max_steps=2", "trainer.ckpt_every=1", "trainer.keep_last=5"]
    live = train(tmp_path / "live", _run_args(pairs_file, *steps))
    pre = train(tmp_path / "pre", _run_args(pairs_file, *steps, "task.precompute_reference=true"))
    cache = pre / REFERENCE_FILE
    assert load_file(cache)["logps"].shape == (24, 2)  # every training and validation pair
    a, b = load_file(live / "model.safetensors"), load_file(pre / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    val = [r for r in read_metrics(pre) if "val/loss" in r][-1]
    want = [r for r in read_metrics(live) if "val/loss" in r][-1]
    assert val["val/rewards/chosen"] == pytest.approx(want["val/rewards/chosen"], abs=1e-5)
    # a resume from step 1 reads the cache back (its file untouched) and ends where the run did
    before = cache.stat().st_mtime_ns
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(pre, resumed, ignore=shutil.ignore_patterns("step_00000002", "model.safetensors"))
    out = run_here(
        "recipes.train",
        *_run_args(pairs_file, *steps, "task.precompute_reference=true"),
        "resume=auto",
        f"hydra.run.dir={resumed}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "read from" in out.stdout + out.stderr and cache.stat().st_mtime_ns == before
    c = load_file(resumed / "model.safetensors")
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_a_dry_run_over_fake_ranks_steps_the_reference_on_the_meta_device(
    pairs_file: Path, tmp_path: Path
) -> None:
    # the frozen reference of a model built on the meta device is built there too: no weights made or read
    fake = ["trainer.dry_run=true", "dist.world_size=2", "trainer.parallel=fsdp"]
    r = run_here("recipes.train", *_run_args(pairs_file, *fake), f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reduce_scatter" in r.stdout + r.stderr  # the step ran: its gradients were reduced over the ranks


# ---- LoRA ------------------------------------------------------------------------------------------------
def test_under_lora_the_reference_is_the_base_with_no_copy_kept(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
    from core.nn.lora import LoRAConfig, apply_lora, lora_modules
    from tests.text.test_hf_llama import ours, reference

    base = reference("llama3_untied")
    folder = tmp_path / "base"
    base.save_pretrained(folder)
    model = ours(folder)
    apply_lora(model, LoRAConfig(rank=4, targets=["q_proj", "v_proj"]), external_name=model.external_name)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.1)
    task = PreferenceTuning(model={"name": "llama"}, data={"name": "preference"})
    _, (tokens, targets, _) = _batch()
    got = task.reference_forward(model, tokens, targets)
    assert task.initial is None and task.reference is None  # no copy of the model was built
    with torch.no_grad():
        want = completion_logps(ours(folder)(tokens), targets).sum(1)  # the base model, no adapters
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(model(tokens), ours(folder)(tokens), atol=1e-3)  # the adapters do act


@pytest.mark.slow  # a run and an export: ~10 s
def test_a_lora_dpo_run_exports_adapters_peft_loads_with_our_logits(pairs_file: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft (the `hf` extra) is not installed")
    from recipes.cli.runs import load_run
    from tests.text.test_hf_llama import reference

    folder = tmp_path / "base"
    theirs = reference("llama3_untied")
    theirs.save_pretrained(folder)
    lora = ["trainer.lora.rank=4", "trainer.lora.targets=[q_proj,v_proj,down_proj]", "optim.lr=1e-2"]
    run = train(
        tmp_path / "run", _run_args(pairs_file, f"model.weights={folder}", "trainer.max_steps=3", *lora)
    )
    first = next(r for r in read_metrics(run) if r["step"] == 0)
    assert first["val/loss"] == pytest.approx(math.log(2), abs=1e-6)  # adapters start at zero: policy = base
    assert run_here("recipes.export", f"ckpt={run}", "format=peft").returncode == 0
    loaded = peft.PeftModel.from_pretrained(type(theirs).from_pretrained(folder), run / "export" / "adapter")
    model = load_run(run, device="cpu").model.float().eval()
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        assert (want - theirs(input_ids=ids).logits).abs().max() > 1e-4  # DPO moved it off the base
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.slow  # three processes of ~10 s each
def test_a_run_killed_with_sigkill_resumes_bit_exact_reading_its_reference_back(
    pairs_file: Path, tmp_path: Path
) -> None:
    import sys

    from safetensors.torch import load_file

    from tests.helpers import dist_env_vars, killed_and_resumed

    steps = ["trainer.max_steps=8", "trainer.ckpt_every=1", "trainer.keep_last=20", "trainer.batch_size=2"]
    args = _run_args(pairs_file, *steps, "task.precompute_reference=true")
    cmd = [sys.executable, "-m", "recipes.train", *args]
    run, resumed = killed_and_resumed(cmd, tmp_path, 3, dist_env_vars())
    assert "reference log-probabilities of 24 pairs read from" in resumed.stdout + resumed.stderr
    cache = load_file(run / REFERENCE_FILE)["logps"]
    assert torch.equal(cache, load_file(tmp_path / "a" / REFERENCE_FILE)["logps"])


@pytest.mark.slow  # two torchrun ranks and one process: ~40 s
def test_two_fsdp_ranks_share_the_precomputed_reference_of_one_process(
    pairs_file: Path, tmp_path: Path
) -> None:
    # the folder read shard by shard under FSDP, LoRA adapters: each rank computes half the reference
    # log-probabilities through the sharded model with its adapters off; summed, they are one process's
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers import dist_env_vars
    from tests.text.test_hf_llama import reference

    folder = tmp_path / "base"
    reference("llama3_untied").save_pretrained(folder)
    args = _run_args(
        pairs_file,
        f"model.weights={folder}",
        "trainer.lora.rank=4",
        "task.precompute_reference=true",
        "trainer.max_steps=2",
    )

    def run(name: str, *extra: str) -> Path:
        cmd = [sys.executable, "-m", "recipes.train", *args, *extra, f"hydra.run.dir={tmp_path / name}"]
        r = subprocess.run(cmd, env=dist_env_vars(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return tmp_path / name

    two = run("two", "trainer.parallel=fsdp", "dist.nproc_per_node=2")
    one = run("one")
    a, b = load_file(one / REFERENCE_FILE)["logps"], load_file(two / REFERENCE_FILE)["logps"]
    assert a.shape == (24, 2) and (a != 0).all()  # every pair computed, on one rank or the other
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    rows = [r for r in read_metrics(two) if "train/loss" in r]
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-4)  # adapters start at zero
