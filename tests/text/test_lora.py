"""LoRA (core/nn/lora.py) on model=llama against peft's LoRA on transformers' LlamaForCausalLM, the test-only
`hf` extra: with the same A and B, logits and every adapter gradient within 1e-6 (float64); an adapter folder
written here loads with `PeftModel.from_pretrained` and gives our logits (1e-5, fp32, the base models'
tolerance in test_hf_llama.py); merging keeps the logits; only the adapters train. Through the stage and the
recipes: activation checkpointing keeps the gradients, each block compiles in one graph, a 4-rank FSDP dry run
shards the adapters alone, a resumed 3-step lm run is bit-exact with checkpoints of the adapters alone, and
recipes.export writes the merged (format=hf) and adapter (format=peft) folders transformers and peft load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.distributed.mesh import MeshShape
from core.distributed.parallelize import parallelize
from core.errors import ConfigError
from core.loop.callbacks import EarlyStopConfig
from core.loop.config import TrainerConfig, check_config
from core.nn.lora import (
    LoRAConfig,
    LoRALinear,
    adapter_state,
    adapters_off,
    apply_lora,
    lora_modules,
    merge_lora,
)
from core.optim import OptimConfig, build_optimizer
from tests.helpers import fault
from text.checkpoints.hf import hf_module_name, write_adapter, write_folder

peft = pytest.importorskip("peft", reason="peft (the `hf` extra) is not installed")
from tests.text.test_hf_llama import VOCAB, ours, reference  # noqa: E402  (after the skip: needs transformers)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASE = "llama3_untied"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reference model's save_pretrained folder."""
    path = tmp_path_factory.mktemp("base")
    reference(CASE).save_pretrained(path)
    return path


def adapted(folder: Path, targets: list[str], *, rank: int = 4, alpha: float = 8.0) -> torch.nn.Module:
    """Our model from `folder` with adapters on `targets`, B random (peft's B starts at zero, which would
    leave A's gradient zero and the update invisible)."""
    model = ours(folder)
    apply_lora(model, LoRAConfig(rank=rank, alpha=alpha, targets=targets), external_name=model.external_name)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    return model


def peft_twin(folder: Path, model: torch.nn.Module, targets: list[str], rank: int, alpha: float) -> Any:
    """peft's LoRA on the reference model, its A and B copied from `model`'s."""
    ref = type(reference(CASE)).from_pretrained(folder)
    twin = peft.get_peft_model(ref, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    theirs = dict(twin.named_parameters())
    with torch.no_grad():
        for key, value in adapter_state(model, hf_module_name).items():
            theirs[key.replace(".weight", ".default.weight")].copy_(value)
    return twin


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL])
def test_logits_and_adapter_gradients_equal_peft(folder: Path, targets: list[str]) -> None:
    model = adapted(folder, targets).double()
    twin = peft_twin(folder, model, targets, 4, 8.0).double().eval()
    ids = tokens()
    got = model(ids)
    want = twin(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # a loss that weighs every logit differently, so each gradient entry is checked
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    theirs = dict(twin.named_parameters())
    mods = lora_modules(model)
    assert len(mods) == 2 * len(targets)  # two layers, each target once per layer
    for name, m in mods.items():
        for part in ("lora_A", "lora_B"):
            ref_p = theirs[f"base_model.model.{hf_module_name(name)}.{part}.default.weight"]
            assert getattr(m, part).weight.grad.abs().max() > 0
            torch.testing.assert_close(getattr(m, part).weight.grad, ref_p.grad, atol=1e-6, rtol=0)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_default_init_starts_at_the_base_model(folder: Path) -> None:
    model = ours(folder)
    base = model(tokens())
    apply_lora(model, LoRAConfig(rank=8, targets=ALL), external_name=model.external_name)
    for m in lora_modules(model).values():
        assert torch.count_nonzero(m.lora_B.weight) == 0
        bound = 1 / m.in_features**0.5  # kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
        assert 0.5 * bound < m.lora_A.weight.abs().max() <= bound
    assert torch.equal(model(tokens()), base)


def test_adapters_off_gives_the_base_and_peft_disable_adapter_logits(folder: Path) -> None:
    model = adapted(folder, ALL)
    twin = peft_twin(folder, model, ALL, 4, 8.0).eval()
    with torch.no_grad():
        base, on = ours(folder)(tokens()), model(tokens())
        with adapters_off(model), twin.disable_adapter():
            assert torch.equal(model(tokens()), base)  # the same weights, no update added
            torch.testing.assert_close(twin(input_ids=tokens()).logits, base, atol=1e-5, rtol=0)
        assert torch.equal(model(tokens()), on) and not torch.allclose(on, base, atol=1e-3)  # back on


def test_adapter_folder_loads_in_peft_with_our_logits(folder: Path, tmp_path: Path) -> None:
    model = adapted(folder, ALL)
    write_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(ALL))
    base = type(reference(CASE)).from_pretrained(folder)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    theirs = dict(loaded.named_parameters())
    for key, value in adapter_state(model, hf_module_name).items():
        assert torch.equal(theirs[key.replace(".weight", ".default.weight")], value)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), loaded(input_ids=tokens()).logits, atol=1e-5, rtol=0)


def test_merged_export_gives_the_adapter_models_logits(folder: Path, tmp_path: Path) -> None:
    model = adapted(folder, ALL)
    with torch.no_grad():
        want = model(tokens())
        merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        assert not any("lora_" in n for n, _ in model.named_parameters())
        torch.testing.assert_close(model(tokens()), want, atol=1e-5, rtol=0)
        write_folder(model, tmp_path / "merged")
        back = type(reference(CASE)).from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(back(input_ids=tokens()).logits, want, atol=1e-5, rtol=0)


def test_only_the_adapters_train_and_reach_the_optimizer(folder: Path) -> None:
    model = ours(folder)
    total = sum(p.numel() for p in model.parameters())
    wrapped = apply_lora(
        model, LoRAConfig(rank=4, targets=["q_proj", "v_proj"]), external_name=model.external_name
    )
    assert wrapped == [f"blocks.{i}.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = {id(p) for n, p in model.named_parameters() if p.requires_grad}
    adapters = {id(p) for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)}
    assert trainable == adapters
    opt = build_optimizer(model, OptimConfig())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == adapters
    # the base parameters are kept, not copied: the model's size grows by the adapters alone
    d, q, kv = 32, 32, 16  # hidden, q_proj's and v_proj's outputs (4 and 2 heads of 8)
    assert sum(p.numel() for p in model.parameters()) == total + 2 * 4 * ((d + q) + (d + kv))


TINY_LM = [
    "+task=lm",
    "model=llama",
    "trainer=smoke",
    "trainer.batch_size=4",
    "trainer.ckpt_every=1",
    "trainer.limit_val_batches=1",
    "trainer.keep_last=0",
    "trainer.export=last",
    "trainer.lora.rank=4",
    "trainer.lora.dropout=0.1",  # draws from the RNG, which a resumed run must restore
    "trainer.lora.targets=[q_proj,v_proj,down_proj]",
    "logger=none",
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.hidden=64",
    "task.context=32",
    "task.val_chunks=4",
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step LoRA run of the lm recipe on model=llama, a checkpoint each step, all kept."""
    from recipes.train import main

    run = tmp_path_factory.mktemp("lora") / "run"
    main([*TINY_LM, "trainer.max_steps=3", f"hydra.run.dir={run}"])
    return run


def test_a_resumed_lora_run_is_bit_exact_and_checkpoints_only_the_adapters(
    lora_run: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file

    from recipes.train import main

    whole, resumed = lora_run, tmp_path / "resumed"
    ckpt = whole / "checkpoints" / "step_00000001"
    weights = torch.load(ckpt / "model.pt", weights_only=True)
    adapters = {f"blocks.0.{m}.lora_{p}.weight" for m in ("q_proj", "v_proj", "mlp.down") for p in "AB"}
    assert set(weights) == adapters  # the frozen base is not written
    moments = torch.load(ckpt / "train.pt", weights_only=False)["optimizer"]["state"]
    assert len(moments) == len(adapters)  # AdamW's moments of the adapters alone
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    main([*TINY_LM, "trainer.max_steps=3", "resume=auto", f"hydra.run.dir={resumed}"])
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and adapters <= a.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["blocks.0.q_proj.lora_B.weight"].abs().max() > 0  # the adapters trained (B starts at zero)


def test_a_lora_run_exports_merged_as_hf_and_its_adapters_as_peft(lora_run: Path, tmp_path: Path) -> None:
    import copy

    from recipes.cli.runs import load_run
    from recipes.export import run as export

    assert export([f"ckpt={lora_run}", "format=hf"]) == 0
    assert export([f"ckpt={lora_run}", "format=peft"]) == 0
    entries = json.loads((lora_run / "export" / "export.json").read_text())
    assert entries["hf"]["max_abs_error"] <= 1e-5  # merged weights against the adapter model
    assert entries["adapter"]["max_abs_error"] == 0.0  # the adapters read back into reset ones
    config = json.loads((lora_run / "export" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 16.0, 0.1)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    model = load_run(lora_run, device="cpu").model.float()
    # the run's base as a Hugging Face folder: its adapters' B zeroed, so merging adds nothing
    base = copy.deepcopy(model)
    with torch.no_grad():
        for m in lora_modules(base).values():
            m.lora_B.weight.zero_()
    write_folder(merge_lora(base), tmp_path / "base")
    llama = type(reference(CASE))
    loaded = peft.PeftModel.from_pretrained(
        llama.from_pretrained(tmp_path / "base"), lora_run / "export" / "adapter"
    )
    merged = llama.from_pretrained(lora_run / "export" / "hf").eval()
    ids = torch.randint(0, model.tok_emb.num_embeddings, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_lora_applied_by_the_stage_composes_with_activation_checkpointing(folder: Path, mode: str) -> None:
    lora = LoRAConfig(rank=4, targets=ALL)
    grads = []
    for checkpointing in ("none", mode):
        torch.manual_seed(0)  # the same A in both models
        model = parallelize(
            ours(folder).train(), MeshShape(), activation_checkpointing=checkpointing, lora=lora
        )
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            f"{n}.lora_{p}.weight" for n in lora_modules(model) for p in "AB"
        }
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.weight.fill_(0.01)
        model(tokens()).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 2 * len(ALL)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5)  # recompute: fp32 reordering only


def test_lora_config_errors_name_their_key(folder: Path) -> None:
    with pytest.raises(ConfigError) as e:
        apply_lora(ours(folder), LoRAConfig(rank=4, targets=["qkv"]), external_name=None)
    assert fault(e.value)[:2] == ("trainer.lora.targets", "['qkv']")
    with pytest.raises(ConfigError) as e:
        check_config(
            TrainerConfig(parallel="fsdp_tp", lora=LoRAConfig(rank=8)), OptimConfig(), EarlyStopConfig()
        )
    assert fault(e.value)[:2] == ("trainer.parallel", "fsdp_tp")
    with pytest.raises(ConfigError) as e:
        check_config(TrainerConfig(lora=LoRAConfig(rank=-1)), OptimConfig(), EarlyStopConfig())
    assert fault(e.value)[:2] == ("trainer.lora.rank", "-1")
    check_config(TrainerConfig(parallel="fsdp", lora=LoRAConfig(rank=8)), OptimConfig(), EarlyStopConfig())


def test_a_dry_run_shards_the_adapters_alone_under_fsdp(folder: Path) -> None:
    from core.distributed import mesh_shape
    from core.distributed.dry_run import dry_run
    from core.registry import MODELS

    sizes = {"vocab_size": VOCAB, "context": 64, "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2}

    def build() -> torch.nn.Module:
        return MODELS.build("llama", hidden=64, **sizes)

    lora = LoRAConfig(rank=4, targets=ALL)
    report = dry_run(build, mesh_shape("fsdp", 4), step=lambda m: m(tokens()).float().mean(), lora=lora)
    model = build()
    apply_lora(model, lora, external_name=model.external_name)
    adapters = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # every adapter dimension FSDP splits (rank 4, outputs 16 to 64) divides by 4: no padding
    assert report.grad_bytes == adapters // 4 and report.optimizer_bytes == 2 * report.grad_bytes
    full = sum(p.numel() * 4 for p in model.parameters())
    assert full // 4 <= report.param_bytes < full // 2  # the frozen base is sharded too, held without grads
    assert report.collectives.get("reduce_scatter", 0) > 0  # the adapters' gradients are reduced


def test_each_adapted_block_compiles_in_one_graph_with_the_eager_output(folder: Path) -> None:
    model = adapted(folder, ALL)
    want = model(tokens())
    for block in model.blocks:  # regional compile's unit; fullgraph: a graph break would raise
        block.compile(backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(model(tokens()), want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_2_rank_fsdp_lora_run_of_an_hf_folder_checkpoints_the_adapters_alone_and_resumes_bit_exact(
    folder: Path, tmp_path: Path
) -> None:
    # two real torchrun ranks (gloo): the base read shard by shard from the folder, adapters on q/v; the
    # sharded checkpoints hold the adapters and their moments alone, a run resumed from step 4 repeats the
    # straight run's losses, and model.safetensors is the folder's base with the trained adapters
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from tests.helpers import launched_losses

    args = ["+task=lm", "model=llama", f"model.weights={folder}", "trainer=smoke", "task.context=32"]
    args += ["trainer.batch_size=4", "precision=fp32", "compile.policy=off", "logger=none"]
    args += ["trainer.parallel=fsdp", "dist.nproc_per_node=2", "trainer.lora.rank=4", "trainer.max_steps=8"]
    args += ["trainer.ckpt_every=4", "trainer.keep_last=5"]

    def train(run: str, *extra: str) -> dict[int, float]:
        return launched_losses(tmp_path / run, [*args, *extra])

    straight = train("straight")
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000004"
    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    adapters = {f"blocks.{b}.{m}.lora_{p}.weight" for b in (0, 1) for m in ("q_proj", "v_proj") for p in "AB"}
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == adapters
    moments = {k for k in saved if k.startswith("optim.state.")}
    assert {k.removeprefix("optim.state.").rpartition(".")[0] for k in moments} == adapters
    resumed = train("resumed", f"resume={ckpt}")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == straight[s] for s in resumed)  # bit-exact: the same layout resumed
    out = load_file(tmp_path / "straight" / "model.safetensors")
    base = load_file(folder / "model.safetensors")
    assert torch.equal(out["blocks.1.mlp.down.weight"], base["model.layers.1.mlp.down_proj.weight"])
    trained = out["blocks.0.q_proj.lora_A.weight"]
    # one whole draw sliced per rank: A's rows, two on each rank, are not the same numbers twice
    assert not torch.equal(trained[:2], trained[2:])
    assert out["blocks.0.q_proj.lora_B.weight"].abs().max() > 0
