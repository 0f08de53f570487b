"""Mixture-of-experts decoders (text/moe.py, `model=qwen3_moe`, `model.weights=` a Qwen3MoeForCausalLM
folder). tests/text/test_hf_llama.py's Qwen3-MoE cases check logits, greedy ids, the round trip, sharded
folders and recipes.generate / recipes.eval against transformers' own Qwen3MoeForCausalLM (the test-only
`hf` extra, whose absence skips this file too); here, against it: the blocks routed, the router's auxiliary
loss and the loss with it, the exported config.json, a peft adapter; and on our own: the grouped experts
equal the per-expert loop (forward and every gradient), Qwen3-MoE's block rule, the lm step adds the
balancing loss when training only, bad options are one line naming the key (exit 2), the presets' parameter
counts, and a LoRA SFT run of an MoE folder trains the adapters alone."""

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
from text.llama import DecoderConfig, Llama
from text.lm import LanguageModeling
from text.moe import MoE, grouped_mm_works, moe_layers, router_balance

transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
from tests.text import test_hf_llama  # noqa: E402  (after the skip: it needs transformers)
from tests.text.test_hf_llama import VOCAB, _edit_config, ours, reference  # noqa: E402

#: test_hf_llama's saved references (its Qwen3-MoE cases among them), shared as pytest finds a fixture
folders = test_hf_llama.folders

MOE_CASES = ["qwen3_moe_untied", "qwen3_moe_tied"]


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


@pytest.mark.parametrize("case", MOE_CASES)
def test_the_routers_auxiliary_loss_and_the_loss_with_it_equal_transformers(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    routed = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers]
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == routed and any(routed) and not all(routed)
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


@pytest.mark.parametrize("case", MOE_CASES)
def test_the_exported_config_is_transformers_own_with_num_experts(
    case: str, folders: dict, tmp_path: Path
) -> None:
    ref, folder = folders[case]
    write_folder(ours(folder), tmp_path)
    # every option of transformers' config comes back (the folder's path and version aside; head_dim is
    # written even where the folder left it to its default)
    back, same = (
        type(ref).from_pretrained(tmp_path).config.to_dict(),
        {"_name_or_path", "transformers_version"},
    )
    assert {k: back[k] for k in ref.config.to_dict().keys() - same} == {
        k: v for k, v in ref.config.to_dict().items() if k not in same
    }
    # transformers 5 saved the experts under num_local_experts: written back as num_experts, read as before
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["num_experts"] == 4 and "num_local_experts" not in saved


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
    _, folder = folders["qwen3_moe_untied"]
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
    _, folder = folders["qwen3_moe_untied"]
    other = _edit_config(folder, tmp_path / "other", **bad)
    # the folder has no tokenizer.json: the key is named before the tokenizer, or anything heavier, is read
    proc = run_here("recipes.generate", f"ckpt={other}", "prompt=x", "device=cpu")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and key in proc.stderr


# --- a LoRA SFT run of an MoE folder -------------------------------------------

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
    ref = reference("qwen3_moe_untied")
    ref.config.eos_token_id = ref.generation_config.eos_token_id = tok.eos_id
    ref.save_pretrained(root / "folder")
    tok.backend.save(str(root / "folder" / "tokenizer.json"))
    (root / "folder" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return ref, root / "folder", tok, data


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
        f"blocks.{i}.{m}.lora_{p}.weight" for i in range(2) for m in ("q_proj", "v_proj") for p in "AB"
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

    ref, folder = folders["qwen3_moe_untied"]
    model = ours(folder)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    assert len(apply_lora(model, lora, external_name=model.external_name)) == 2 * 2
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():  # B random: peft's zero B would hide the update
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    write_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(type(ref).from_pretrained(folder), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), loaded(input_ids=tokens()).logits, atol=1e-5, rtol=0)
