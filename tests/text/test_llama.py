"""The Llama-style decoder without transformers: packed documents equal running each alone, the KV cache
equals the full forward, the presets' parameter counts, the TP plan in a dry run, its one-line configuration
errors, the LM recipe training and exporting it, and tokenizer=pretrained. (tests/text/test_hf_llama.py
compares it with transformers; tests/core/test_layers.py its layers.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import text  # noqa: F401  (registers the models and the tensor-parallel plans)
from core.distributed import MeshShape, mesh_shape
from core.distributed.dry_run import dry_run
from core.errors import ConfigError
from core.registry import MODELS
from tests.helpers import fault
from text.generation import generate
from text.llama import DecoderConfig, Llama


def tiny(seed: int = 0, **options: object) -> Llama:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=50, context=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, hidden=48)
    model = Llama(DecoderConfig(**{**sizes, **options})).eval()
    with torch.no_grad():  # norms away from 1, so a wrongly applied gain shows
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("options", [{}, {"qk_norm": True, "qkv_bias": True, "rope_factor": 8.0}])
def test_each_packed_document_equals_running_it_alone(options: dict) -> None:
    model = tiny(**options)
    doc_ids = torch.tensor([[0] * 10 + [1] * 15 + [2] * 7])
    tokens = torch.randint(0, 50, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(tokens, doc_ids)
        for d in range(3):
            alone = model(tokens[doc_ids == d][None])
            # same math on shorter rows: fp32 reassociation only
            torch.testing.assert_close(packed[doc_ids == d], alone[0], atol=1e-5, rtol=1e-5)


def test_kv_cached_prefill_and_decoding_equal_the_full_forward() -> None:
    model = tiny(qk_norm=True)
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(batch=2)
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :12], cache=cache), model(tokens[:, 12:15], cache=cache)]
        pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(15, 20)]
    assert cache.length == 20 and cache.keys.shape[2] == 2  # two key/value heads cached, not four
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generation_with_the_cache_equals_without() -> None:
    model = tiny(seed=4)
    prompt = torch.tensor([1, 2, 3])
    cached = generate(model, prompt, 40, temperature=0.0)  # past the 32-position context: the window restarts
    plain = generate(model, prompt, 40, temperature=0.0, use_cache=False)
    assert cached.tolist() == plain.tolist() and len(cached) == 40


def test_presets_have_llama_3s_parameter_counts_on_the_meta_device() -> None:
    with torch.device("meta"):
        counts = {
            name: sum(p.numel() for p in MODELS.build(name, vocab_size=vocab, context=8192).parameters())
            for name, vocab in (("llama_8b", 128256), ("llama_1b", 128256), ("llama_125m", 50257))
        }
    # Llama 3.1 8B (untied head) and Llama 3.2 1B (tied) as Meta publishes them, 8,030,261,248 and
    # 1,235,814,400 parameters; the 125M preset with GPT-2's vocabulary, tied
    assert counts == {"llama_8b": 8_030_261_248, "llama_1b": 1_235_814_400, "llama_125m": 124_730_880}
    debug = sum(p.numel() for p in MODELS.build("llama", vocab_size=258, context=128).parameters())
    assert 1e6 < debug < 5e6  # a CPU size: a few million


def test_the_8b_preset_lays_out_over_256_ranks_with_its_tensor_parallel_plan() -> None:
    def build() -> torch.nn.Module:
        return MODELS.build("llama_8b", vocab_size=128256, context=8192)

    with torch.device("meta"):
        model = build()
    blocks = sum(p.numel() for p in model.blocks.parameters())
    rest = sum(p.numel() for p in model.parameters()) - blocks
    report = dry_run(build, mesh_shape("fsdp_tp", 256, tp=8))
    # the blocks' matrices split 256 ways (TP 8 x FSDP 32), their norms and the embeddings/head 32 ways
    # (FSDP alone), rows padded: rank 0 holds that within 1%, fp32
    assert report.param_bytes == pytest.approx(4 * (blocks / 256 + rest / 32), rel=0.01)
    assert report.optimizer_bytes == 2 * report.param_bytes


def test_tensor_parallel_wider_than_the_key_value_heads_is_one_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        dry_run(lambda: tiny(), MeshShape(dp_shard=2, tp=4))
    assert fault(err.value) == ("model.n_kv_head", "2", ("a multiple of trainer.tp=4",))


@pytest.mark.parametrize(
    ("options", "key", "value"),
    [
        ({"n_head": 4, "n_kv_head": 3}, "model.n_kv_head", "3"),
        ({"d_model": 30, "n_head": 4}, "model.n_head", "4"),
        ({"head_dim": 7}, "model.head_dim", "7"),
    ],
)
def test_impossible_sizes_are_config_errors(options: dict, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny(**options)
    assert fault(err.value)[:2] == (key, value)


def test_the_lm_recipe_trains_model_llama_and_exports_it_as_a_hugging_face_folder(tmp_path: Path) -> None:
    from recipes.export import run as export
    from recipes.train import main
    from text.checkpoints.hf import read_folder

    tiny_sizes = [
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.hidden=64",
    ]
    args = [
        "+task=lm",
        "model=llama",
        "trainer=smoke",
        "trainer.max_steps=3",
        "trainer.batch_size=4",
        "logger=none",
    ]
    main([*args, *tiny_sizes, "task.context=32", "task.val_chunks=4", f"hydra.run.dir={tmp_path}"])
    metrics = json.loads((tmp_path / "result.json").read_text())["metrics"]
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] < 7.0  # ln(258) = 5.55 at chance
    assert export([f"ckpt={tmp_path}", "format=hf"]) == 0
    folder = tmp_path / "export" / "hf"
    entry = json.loads((tmp_path / "export" / "export.json").read_text())["hf"]
    assert entry["max_abs_error"] == 0.0  # the same tensors, read back: the same logits bit for bit
    assert read_folder(folder).sizes["n_kv_head"] == 2
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tokenizer_pretrained_is_the_weights_folders_tokenizer_json(tmp_path: Path) -> None:
    from text.checkpoints.hf import write_folder
    from text.lm import LanguageModeling
    from text.tokenizer import EOS, BPETokenizer

    texts = ["In the beginning God created the heaven and the earth."] * 4
    bpe = BPETokenizer.train(texts, 300, cache_dir=tmp_path / "cache")
    bpe.backend.save(str(tmp_path / "tokenizer.json"))
    model = tiny(vocab_size=320)  # embedding rows past the tokenizer's ids, as Qwen's folders have
    write_folder(model, tmp_path, base_config={"eos_token_id": bpe.backend.token_to_id(EOS)})
    task = LanguageModeling(
        model={"name": "llama", "weights": str(tmp_path)},
        data={"name": "kjv"},
        tokenizer="pretrained",
        context=32,
    )
    tok = task.tokenizer
    assert (tok.vocab_size, tok.eos_id) == (bpe.vocab_size, bpe.eos_id)
    assert tok.encode(texts[0]) == bpe.encode(texts[0]) and tok.decode(tok.encode(texts[0])) == texts[0]
    loaded = task.build_model()
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in loaded.state_dict().items())


def test_tokenizer_pretrained_without_model_weights_is_one_config_error() -> None:
    from text.lm import LanguageModeling

    with pytest.raises(ConfigError) as err:
        LanguageModeling(model={"name": "llama"}, data={"name": "kjv"}, tokenizer="pretrained")
    assert fault(err.value)[:2] == ("model.weights", "")


def test_a_transformers_4_style_config_of_llama_3_1_8b_gives_the_8b_preset() -> None:
    from text.checkpoints.hf import sizes_from_config
    from text.pretrained import PRESETS

    # Llama 3.1 8B's published config.json, in the spelling transformers 4 wrote (rope_theta and
    # rope_scaling at the top level; transformers 5 nests both in rope_parameters)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "hidden_act": "silu",
        "mlp_bias": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    sizes = sizes_from_config(config)
    assert {k: sizes[k] for k in PRESETS["llama_8b"]} == PRESETS["llama_8b"]
    defaults = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "norm_eps": 1e-5, "head_dim": 128}
    assert {k: sizes[k] for k in defaults} == defaults
    flags = (sizes["vocab_size"], sizes["qk_norm"], sizes["qkv_bias"], sizes["out_bias"])
    assert flags == (128256, False, False, False)


def test_the_recipes_dry_run_takes_a_preset_with_its_tensor_parallel_plan(tmp_path: Path) -> None:
    from recipes.train import main

    # up-front validation resolves the preset (a builder function) to the class it builds, which has a plan
    sizes = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.hidden=64"]
    layout = ["dist.world_size=8", "trainer.parallel=fsdp_tp", "trainer.tp=2", "trainer.batch_size=8"]
    args = [
        "+task=lm",
        "model=llama",
        "trainer.dry_run=true",
        "task.context=16",
        "logger=none",
        *sizes,
        *layout,
    ]
    main([*args, f"hydra.run.dir={tmp_path}"])
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["mesh"] == {"dp_shard": 4, "tp": 2}
    # FSDP gathers each block for forward and again for backward, and the root; reduce-scatters each once
    assert (
        report["collectives"]["all_gather"] == 2 * 2 + 1 and report["collectives"]["reduce_scatter"] == 2 + 1
    )
