"""Mixture-of-experts decoders (text/moe.py, `model=qwen3_moe`, `model.weights=` a Qwen3MoeForCausalLM
folder) against transformers' own Qwen3MoeForCausalLM (the test-only `hf` extra): tiny random models saved
with save_pretrained; logits within 1e-5 in fp32, the same greedy ids, the router's auxiliary loss (and the
loss with it) equal, a bit-exact write/read round trip, sharded folders. Without transformers: the grouped
experts equal the per-expert loop (forward and every gradient), blocks get experts by Qwen3-MoE's rule, the
lm step adds the balancing loss when training only, bad options are one line naming the key (exit 2), and a
LoRA SFT run of an MoE folder trains the adapters alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError
from core.nn.layers import SwiGLU
from core.registry import MODELS
from tests.helpers import fault, read_metrics, run_here, train
from text.checkpoints.hf import read_folder, write_folder
from text.generation import generate
from text.llama import DecoderConfig, Llama
from text.lm import LanguageModeling
from text.moe import MoE, grouped_mm_works, moe_layers, router_balance

VOCAB = 300
#: transformers' Qwen3MoeConfig keywords: three blocks, the middle one dense (mlp_only_layers)
HF_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "max_position_embeddings": 128,
    "initializer_range": 0.1,  # wide, so the logits (and greedy picks, and routes) differ clearly
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
CASES: dict[str, dict[str, Any]] = {
    "renormalised_untied": {"norm_topk_prob": True, "tie_word_embeddings": False},
    # every second block routed (decoder_sparse_step), the router's probabilities as they are, a tied head
    "every_second_tied": {"decoder_sparse_step": 2, "mlp_only_layers": [], "tie_word_embeddings": True},
}


def reference(case: str, seed: int = 0) -> Any:
    """A random transformers Qwen3MoeForCausalLM of `case`, in eval mode, its norms' gains away from 1."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the `hf` extra) is not installed"
    )
    config = transformers.Qwen3MoeConfig(**(HF_SIZES | CASES[case]))
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Each case's reference model and the folder save_pretrained wrote it to."""
    out = {}
    for case in CASES:
        model = reference(case)
        folder = tmp_path_factory.mktemp(case)
        model.save_pretrained(folder)
        out[case] = (model, folder)
    return out


def ours(folder: Path) -> Llama:
    return MODELS.build("llama", vocab_size=VOCAB, context=64, weights=str(folder)).eval()


def tokens(rows: int = 3, length: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))


def tiny(**options: Any) -> Llama:
    """A random three-block MoE decoder (the middle block dense), widths kernels take (multiples of 16)."""
    sizes = {"vocab_size": 64, "context": 32, "n_layer": 3, "n_head": 4, "n_kv_head": 2, "d_model": 32}
    sizes |= {"hidden": 48, "n_experts": 4, "experts_per_token": 2, "expert_hidden": 16, "dense_layers": [1]}
    torch.manual_seed(0)
    return Llama(DecoderConfig(**(sizes | options)))


def test_the_grouped_experts_equal_the_loop_forward_and_backward() -> None:
    if not grouped_mm_works(torch.device("cpu"), torch.float32, 32, 16):
        pytest.skip("this build has no torch._grouped_mm for fp32 on this CPU")
    model, x = (
        tiny(norm_topk_prob=True),
        torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1)),
    )
    w = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(2))
    results = {}
    for path in ("grouped", "loop"):
        for layer in moe_layers(model):
            layer.experts.path = path
        model.zero_grad()
        out = model(x)
        ((out * w).sum() + router_balance(model).loss).backward()
        results[path] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (grouped, g_grads), (loop, l_grads) = results["grouped"], results["loop"]
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=0)
    for name, grad in l_grads.items():
        assert grad.abs().max() > 0, name  # every parameter, experts and router included, gets a gradient
        torch.testing.assert_close(g_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_blocks_get_experts_by_qwen3_moes_rule() -> None:
    kinds = [type(b.mlp) for b in tiny(n_layer=6, moe_every=2, dense_layers=[3]).blocks]
    assert kinds == [
        SwiGLU,
        MoE,
        SwiGLU,
        SwiGLU,
        SwiGLU,
        MoE,
    ]  # blocks 2, 4, 6 counted from 1; 4 listed dense
    dense = tiny(n_experts=0)
    assert all(isinstance(b.mlp, SwiGLU) for b in dense.blocks) and not moe_layers(dense)


def test_the_lm_step_adds_the_balancing_loss_when_training_and_logs_the_load() -> None:
    model, x = tiny(), torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = (x[:, :-1], x[:, 1:], torch.zeros_like(x[:, 1:]))
    task = SimpleNamespace(packing=False, mixture={})  # the two attributes the step reads
    trained = LanguageModeling.step(task, model.train(), batch)
    evaluated = LanguageModeling.step(task, model.eval(), batch)
    ce = F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())
    aux = trained.metrics["moe/aux_loss"]
    assert 1.0 <= aux <= 4.0  # E * sum f_e P_e: 1 when balanced (top-2 of 4: up to 4)
    torch.testing.assert_close(evaluated.loss, ce)
    torch.testing.assert_close(trained.loss, ce + 0.001 * aux)
    counts = torch.stack([m.stats.counts for m in moe_layers(model)]).float()
    assert counts.sum(1).tolist() == [2 * 16 * 2] * 2  # every token's two pairs, in each MoE layer
    assert evaluated.metrics["moe/load_max_over_mean"] == (counts.amax(1) / counts.mean(1)).max()
    dense = tiny(n_experts=0)
    assert set(LanguageModeling.step(task, dense, batch).metrics) == set()  # a dense model logs nothing new


def test_more_experts_per_token_than_experts_is_one_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        MODELS.build("qwen3_moe", vocab_size=64, context=32, experts_per_token=9)
    assert fault(err.value) == ("model.experts_per_token", "9", ("1 to 8",))


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_on_a_right_padded_batch(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers
    ]
    x, mask = tokens(), torch.ones(3, 20, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    with torch.no_grad():
        want = ref(input_ids=x, attention_mask=mask).logits
        got = model(x, 1 - mask)  # the padding is a second document of each row: never attended to
    real = mask.bool()
    assert want[real].abs().max() > 0.1
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_gives_transformers_ids(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    prompt = torch.tensor([5, 77, 123, 9, 250, 31])
    with torch.no_grad():
        want = ref.generate(
            prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=24
        )
    got = generate(ours(folder), prompt, 24, temperature=0.0).tolist()
    assert got == want[0, 6:].tolist() and len(set(got)) > 1


@pytest.mark.parametrize("case", CASES)
def test_the_routers_auxiliary_loss_and_the_loss_with_it_equal_transformers(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    x = tokens()
    with torch.no_grad():
        theirs = ref(input_ids=x, labels=x, output_router_logits=True)
        logits = model(x)
    balance = router_balance(model)
    torch.testing.assert_close(balance.metrics["moe/aux_loss"], theirs.aux_loss, atol=1e-6, rtol=0)
    assert theirs.aux_loss > 1.0  # not balanced: the loss has something to push against
    # transformers' loss: the shifted cross-entropy plus router_aux_loss_coef x the auxiliary loss
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(ce + balance.loss, theirs.loss, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_write_then_read_back_is_bit_exact_in_both_libraries(
    case: str, folders: dict, tmp_path: Path
) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    write_folder(model, tmp_path)
    back = type(ref).from_pretrained(tmp_path).eval()
    want = ref.state_dict()
    assert back.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items())
    # every option of transformers' config comes back (the folder's path and version aside)
    same = {"_name_or_path": "", "transformers_version": ""}
    assert back.config.to_dict() | same == ref.config.to_dict() | same
    # transformers 5 saved the experts under num_local_experts: written back as num_experts, read as before
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["num_experts"] == 4 and "num_local_experts" not in saved
    again = ours(tmp_path)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in again.state_dict().items())
    assert again.config == model.config


def test_a_sharded_folder_loads_the_same_tensors(folders: dict, tmp_path: Path) -> None:
    ref, folder = folders["renormalised_untied"]
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded, single = ours(tmp_path), ours(folder)
    assert all(torch.equal(t, single.state_dict()[k]) for k, t in sharded.state_dict().items())


#: router options of other mixtures, each refused by its key before any tensor is read
REFUSED = {
    "shared_expert_intermediate_size": 64,  # Qwen2-MoE's shared expert
    "n_shared_experts": 1,  # DeepSeek's
    "scoring_func": "sigmoid",  # DeepSeek-V3's gating
    "topk_method": "noaux_tc",  # DeepSeek-V3's bias-based balancer
}


@pytest.mark.parametrize("key", REFUSED)
def test_a_router_option_text_moe_does_not_compute_is_refused_by_its_key(
    key: str, folders: dict, tmp_path: Path
) -> None:
    from tests.text.test_hf_llama import _edit_config

    _, folder = folders["renormalised_untied"]
    with pytest.raises(ConfigError) as err:
        read_folder(_edit_config(folder, tmp_path / "other", **{key: REFUSED[key]}))
    assert fault(err.value)[:2] == (key, str(REFUSED[key]))


@pytest.mark.parametrize(
    ("bad", "key"),
    [({"scoring_func": "sigmoid"}, "scoring_func"), ({"num_experts_per_tok": 5}, "model.experts_per_token")],
    ids=["sigmoid", "top_5_of_4"],
)
def test_the_recipe_exits_2_on_a_folder_it_cannot_route(
    bad: dict, key: str, folders: dict, tmp_path: Path
) -> None:
    from tests.text.test_hf_llama import _edit_config

    _, folder = folders["renormalised_untied"]
    other = _edit_config(folder, tmp_path / "other", **bad)
    # the folder has no tokenizer.json: the key is named before the tokenizer, or anything heavier, is read
    proc = run_here("recipes.generate", f"ckpt={other}", "prompt=x", "device=cpu")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and key in proc.stderr


# --- the recipes on an MoE folder: generate, eval, LoRA SFT -------------------------------------------

CHATS = [
    [{"role": "user", "content": f"What is {i} plus one?"}, {"role": "assistant", "content": f"{i + 1}"}]
    for i in range(40)
]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Any, Path]:
    """A Qwen3-MoE reference saved with a BPE tokenizer.json and a chat template, and chats beside it:
    (reference, folder, tokenizer, chats.jsonl)."""
    from text.tokenizer import BPETokenizer

    root = tmp_path_factory.mktemp("moe_chat")
    texts = [TEMPLATE] + [m["content"] for c in CHATS for m in c]
    tok = BPETokenizer.train(texts, VOCAB, cache_dir=root / "bpe")
    ref = reference("renormalised_untied")
    ref.config.eos_token_id = ref.generation_config.eos_token_id = tok.eos_id
    ref.save_pretrained(root / "folder")
    tok.backend.save(str(root / "folder" / "tokenizer.json"))
    (root / "folder" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return ref, root / "folder", tok, data


def test_generate_from_an_moe_folder_gives_transformers_greedy_ids(chat_folder: tuple) -> None:
    ref, folder, tok, _ = chat_folder
    prompt = "What is 7 plus"
    args = [f"ckpt={folder}", f"prompt={prompt}", "temperature=0", "max_new_tokens=12", "device=cpu"]
    proc = run_here("recipes.generate", *args, "precision=fp32")
    assert proc.returncode == 0, proc.stderr
    ids = [tok.eos_id, *tok.encode(prompt)]  # the lm task starts a prompt as a document
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            eos_token_id=tok.eos_id,
        )[0, len(ids) :].tolist()
    assert len(want) > 4 and len(set(want)) > 1
    assert proc.stdout.rstrip("\n") == tok.decode(ids + want)


def test_eval_of_an_moe_folder_gives_transformers_loss(chat_folder: tuple, tmp_path: Path) -> None:
    from recipes.cli.runs import apply_overrides, hf_run_config
    from recipes.cli.tasks import build_task

    ref, folder, _, _ = chat_folder
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "sums.txt").write_text(" ".join(m["content"] for c in CHATS for m in c))
    data = ["data=text_files", f"data.root={tmp_path / 'text'}", "data.val_fraction=0.5", "task.context=32"]
    out = tmp_path / "eval.json"
    proc = run_here("recipes.eval", f"ckpt={folder}", *data, "device=cpu", "precision=fp32", f"out={out}")
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(out.read_text())["metrics"]
    overrides = [o if "." in o.split("=")[0] else o.replace("=", ".name=", 1) for o in data]
    _, val = build_task(apply_overrides(hf_run_config(folder), overrides)).build_datasets()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y, d in (val[i] for i in range(len(val))):
            assert (d == d[0]).all()
            ids = torch.cat([x, y[-1:]])[None]
            # transformers' loss without the router's term: evaluation reports the cross-entropy alone
            total += ref(input_ids=ids, labels=ids, output_router_logits=False).loss.item() * len(y)
            count += len(y)
    assert len(val) >= 3
    assert metrics["val/loss"] == pytest.approx(total / count, abs=1e-5)
    assert metrics["val/moe/aux_loss"] >= 1.0


@pytest.mark.slow  # a whole sft run: about 60 s on a loaded 2-vCPU host
def test_a_lora_sft_run_of_an_moe_folder_trains_the_adapters_alone(
    chat_folder: tuple, tmp_path: Path
) -> None:
    from recipes.cli.runs import load_run

    _, folder, _, data = chat_folder
    args = ["+task=sft", f"model.weights={folder}", "tokenizer=pretrained", f"data.train={data}"]
    args += ["trainer=smoke", "task.context=128", "task.eval_questions=0", "logger=none", "precision=fp32"]
    args += ["trainer.lora.rank=4", "trainer.lora.targets=[q_proj,v_proj]", "trainer.max_steps=3"]
    run = train(tmp_path / "run", args)
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert len(rows) == 3 and all(r["train/moe/aux_loss"] >= 1.0 for r in rows)
    model = load_run(run, device="cpu").model
    base = ours(folder)
    trained = dict(model.named_parameters())
    adapters = {n for n in trained if "lora_" in n}
    assert adapters == {
        f"blocks.{i}.{m}.lora_{p}.weight" for i in range(3) for m in ("q_proj", "v_proj") for p in "AB"
    }
    assert trained["blocks.0.q_proj.lora_B.weight"].abs().max() > 0  # trained (B starts at zero)
    # the experts, the router and every other base weight are the folder's, untouched
    for name, p in base.named_parameters():
        assert torch.equal(trained[name], p), name


def test_the_30b_a3b_preset_has_qwen3_30b_a3bs_parameter_counts() -> None:
    from text.moe import active_parameters

    with torch.device("meta"):  # shapes alone: nothing allocated
        model = MODELS.build("qwen3_moe_30b_a3b", vocab_size=151_936, context=4096)
    # Qwen3-30B-A3B's config.json sizes: 30.5 B parameters, 3.3 B of them active per token
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624
    assert active_parameters(model) == 3_353_032_704
    assert len(moe_layers(model)) == 48 and model.head.weight is not model.tok_emb.weight


def test_the_cpu_preset_is_a_few_million_parameters() -> None:
    model = MODELS.build("qwen3_moe", vocab_size=256, context=64)
    assert 5e6 < sum(p.numel() for p in model.parameters()) < 1e7
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)


def test_an_adapter_folder_of_an_moe_model_loads_in_peft_with_our_logits(
    folders: dict, tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft", reason="peft (the `hf` extra) is not installed")
    from core.nn.lora import LoRAConfig, apply_lora, lora_modules
    from text.checkpoints.hf import write_adapter

    ref, folder = folders["renormalised_untied"]
    model = ours(folder)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    assert len(apply_lora(model, lora, external_name=model.external_name)) == 2 * 3
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():  # B random: peft's zero B would hide the update
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    write_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(type(ref).from_pretrained(folder), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), loaded(input_ids=tokens()).logits, atol=1e-5, rtol=0)
