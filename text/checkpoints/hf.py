"""Hugging Face decoder folders (of the classes `ARCHITECTURES` lists: `LlamaForCausalLM`, Qwen2's, ...):
their sizes in `text.llama.DecoderConfig`'s terms through one table of keys (`KEYS`, read on load and
written on export), their tensors mapped onto `text.llama.Llama`, and the model written back as such a folder.
A new Llama-shaped architecture is one `Architecture` entry.

A folder is config.json beside model.safetensors, or beside model.safetensors.index.json and the shards it
names. Only safetensors are read (pickled .bin files are refused, nothing in the folder runs), one tensor at
a time, so a large model never needs two copies in memory. Any fault is a ConfigError whose `key` names the
first config key or tensor that does not fit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.distributed.tensor_parallel import local_shard
from core.errors import ConfigError
from core.nn.lora import is_adapter
from text.llama import DecoderConfig

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"

#: our parameter names -> Hugging Face's, applied in order (the inverse is derived per model, never guessed)
_RENAMES = (
    (r"^tok_emb\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^head\.", "lm_head."),
    (r"^blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.([qkvo]_proj|[qk]_norm)\.", r"model.layers.\1.self_attn.\2."),
    (r"^blocks\.(\d+)\.mlp\.(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
    # text.moe's router and stacked experts (each expert's slice is a tensor of its own: `_EXPERTS`)
    (r"^blocks\.(\d+)\.mlp\.router\.", r"model.layers.\1.mlp.gate."),
    (r"^blocks\.(\d+)\.mlp\.experts\.", r"model.layers.\1.mlp.experts."),
)
#: a stacked (expert, out, in) weight's name once renamed: Hugging Face folders hold one tensor per expert
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate|up|down)$")


def hf_name(name: str) -> str:
    """Our parameter `name` as a Hugging Face Llama/Qwen checkpoint spells it."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def hf_module_name(name: str) -> str:
    """Our module `name` (blocks.0.mlp.gate) as Hugging Face spells it (model.layers.0.mlp.gate_proj)."""
    return hf_name(name + ".")[:-1]  # the renames match up to the dot that ends a module's part


def _fault(message: str, key: str, value: Any, valid: tuple[str, ...]) -> ConfigError:
    return ConfigError(message, key=key, value=str(value), valid=valid)


@dataclass(frozen=True)
class Key:
    """One `DecoderConfig` field and the transformers config.json key holding it, read on load and written
    on export. `place`: config.json itself, its rope parameters, or those of Llama 3 scaling alone."""

    ours: str
    hf: str
    kind: type
    #: the value when the key is absent or null (None: required; a function: of the whole config.json)
    default: Any = None
    place: str = "config"  # "config", "rope" or "llama3"

    def read(self, source: dict[str, Any], config: dict[str, Any]) -> Any:
        """This key's value in `source` (a `place` of `config`) as our type; a required key missing is a
        one-line ConfigError."""
        value = source.get(self.hf)
        if value is None:
            value = self.default(config) if callable(self.default) else self.default
        if value is None:
            raise _fault(f"config.json has no {self.hf}", self.hf, "missing", (self.kind.__name__,))
        return self.kind(value)


#: ours <-> Hugging Face, for every architecture (transformers 5 writes the rope keys in rope_parameters,
#: rope_theta included; earlier versions rope_theta and rope_scaling at the top level)
KEYS = (
    Key("vocab_size", "vocab_size", int),
    Key("n_layer", "num_hidden_layers", int),
    Key("n_head", "num_attention_heads", int),
    Key("n_kv_head", "num_key_value_heads", int, default=lambda c: c["num_attention_heads"]),
    Key("d_model", "hidden_size", int),
    Key("head_dim", "head_dim", int, default=lambda c: c["hidden_size"] // c["num_attention_heads"]),
    Key("hidden", "intermediate_size", int),
    Key("norm_eps", "rms_norm_eps", float, default=1e-6),
    Key("tie_embeddings", "tie_word_embeddings", bool, default=False),
    Key("rope_theta", "rope_theta", float, default=10_000.0, place="rope"),
    Key("rope_factor", "factor", float, place="llama3"),
    Key("rope_low_freq_factor", "low_freq_factor", float, place="llama3"),
    Key("rope_high_freq_factor", "high_freq_factor", float, place="llama3"),
    Key("rope_original_context", "original_max_position_embeddings", int, place="llama3"),
)

#: ... and those of the mixture-of-experts decoders alone (transformers 5 writes num_experts as
#: num_local_experts; the hub's folders, and transformers 4, spell it num_experts)
MOE_KEYS = (
    Key("n_experts", "num_experts", int, default=lambda c: c.get("num_local_experts")),
    Key("experts_per_token", "num_experts_per_tok", int),
    Key("expert_hidden", "moe_intermediate_size", int),
    Key("norm_topk_prob", "norm_topk_prob", bool, default=False),
    Key("moe_every", "decoder_sparse_step", int, default=1),
    Key("dense_layers", "mlp_only_layers", tuple, default=()),
    Key("router_aux_loss_coef", "router_aux_loss_coef", float, default=0.001),
)
#: router options of other mixtures (Qwen2-MoE's and DeepSeek's shared experts, DeepSeek-V3's bias-based
#: balancer and sigmoid gating, router noise) that text.moe does not compute: a folder with one is refused
MOE_REFUSED: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (0, None),
    "n_shared_experts": (0, None),
    "num_shared_experts": (0, None),
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "routed_scaling_factor": (1.0, None),
    "router_jitter_noise": (0.0, None),
}

#: config.json values every architecture must have (absent: fine), the first written on export
REQUIRED: dict[str, tuple[Any, ...]] = {"hidden_act": ("silu",)}
#: ... and those no architecture may have other than these (absent: fine), never written
REFUSED: dict[str, tuple[Any, ...]] = {"mlp_bias": (False,), "use_sliding_window": (False,)}


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face decoder class `text.llama.Llama` computes exactly: the options it fixes and the
    config.json values it requires (checked on load, the first written on export)."""

    name: str
    model_type: str
    qk_norm: bool = False
    biases: tuple[bool, bool] | None = None  # (q/k/v, output) fixed; None: both config.json's attention_bias
    requires: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: config.json keys of this architecture alone (read and written), and values it refuses (never written)
    keys: tuple[Key, ...] = ()
    refuses: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def fits(self, config: DecoderConfig) -> bool:
        """Whether a model of `config` is this architecture's."""
        biases = (config.qkv_bias, config.out_bias)
        same = self.biases == biases if self.biases else biases[0] == biases[1]
        experts = any(k.ours == "n_experts" for k in self.keys)
        return self.qk_norm == config.qk_norm and same and experts == bool(config.n_experts)


#: every architecture loaded and written, one entry each; the first that fits a model writes it by default
ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", requires={"mlp_bias": (False,)}),
        Architecture(
            "Qwen2ForCausalLM", "qwen2", biases=(True, False), requires={"use_sliding_window": (False,)}
        ),
        Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, requires={"use_sliding_window": (False,)}),
        Architecture(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            qk_norm=True,
            requires={"use_sliding_window": (False,)},
            keys=MOE_KEYS,
            refuses=MOE_REFUSED,
        ),
        # Llama's math without biases while the window is off: a real sliding window is refused by name
        Architecture(
            "MistralForCausalLM", "mistral", biases=(False, False), requires={"sliding_window": (None,)}
        ),
    )
}


@dataclass
class HFFolder:
    """A Hugging Face decoder folder, read: its config, our sizes from it, and where each tensor lives."""

    path: Path
    config: dict[str, Any]
    sizes: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)  # tensor name -> the safetensors file holding it


def read_folder(path: str | Path) -> HFFolder:
    """The folder's config.json turned into `Llama` sizes, and its tensor index; ConfigError on a folder
    of another architecture, an unsupported option, or weights that are not safetensors."""
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise _fault(
            f"model.weights={path} is not a Hugging Face model folder (no config.json in it)",
            "model.weights",
            path,
            ("a folder with config.json and model.safetensors",),
        )
    config = _config_json(config_file, f"model.weights={path}: config.json", "config.json")
    return HFFolder(folder, config, sizes_from_config(config), _tensor_files(folder))


def _config_json(file: Path, named: str, key: str) -> dict[str, Any]:
    """`file` (a config.json) read; a one-line ConfigError naming it as `named`, with `key`, where it is not
    readable JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        message = f"{named} is not readable JSON ({type(e).__name__})"
        raise _fault(message, key, str(file.parent), ("a Hugging Face config.json",)) from None


#: a Hugging Face sequence classifier (a reward model's class) -> the decoder class its trunk is
CLASSIFIERS = {name.removesuffix("ForCausalLM") + "ForSequenceClassification": name for name in ARCHITECTURES}


def read_classifier(path: str | Path) -> tuple[HFFolder, int]:
    """(the folder, its label count) of a Hugging Face `*ForSequenceClassification` folder of a decoder
    `CLASSIFIERS` lists (a reward model: `model.*` tensors and a `score` head); its sizes are its decoder's.
    ConfigError naming the key for a folder of another class or an unsupported option."""
    folder = Path(path).expanduser()
    config = _config_json(folder / "config.json", f"task.rewards: {path}/config.json", "task.rewards")
    arch = (config.get("architectures") or [""])[0]
    if arch not in CLASSIFIERS:
        raise _fault(
            f"task.rewards: {path} holds a {arch or 'model of no named class'}, not a reward model torchkiln "
            f"loads; valid: {', '.join(CLASSIFIERS)}",
            "architectures",
            arch,
            tuple(CLASSIFIERS),
        )
    sizes = sizes_from_config({**config, "architectures": [CLASSIFIERS[arch]]})
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return HFFolder(folder, config, sizes, _tensor_files(folder)), int(labels)


def sizes_from_config(config: dict[str, Any]) -> dict[str, Any]:
    """`DecoderConfig` keyword sizes from a transformers config.json's keys (`KEYS`), for one of
    `ARCHITECTURES`; a one-line ConfigError naming the first key that does not fit."""
    arch = _architecture_named(config)
    for key, valid in (REQUIRED | REFUSED | arch.requires | arch.refuses).items():
        if key in config and config[key] not in valid:
            raise _fault(
                f"config.json: {key}={config[key]} is not supported; valid: {', '.join(map(str, valid))}",
                key,
                config[key],
                tuple(str(v) for v in valid),
            )
    rope = dict(config.get("rope_scaling") or {}) | dict(config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise _fault(
            f"config.json: rope_type={rope_type} is not supported; valid: default, llama3",
            "rope_type",
            rope_type,
            ("default", "llama3"),
        )
    places = {"config": config, "rope": {"rope_theta": config.get("rope_theta")} | rope, "llama3": rope}
    used = [k for k in KEYS + arch.keys if k.place != "llama3" or rope_type == "llama3"]
    sizes = {"n_experts": 0} | {k.ours: k.read(places[k.place], config) for k in used}
    sizes.setdefault("rope_factor", 0.0)  # no scaling (the other Llama 3 options are left as given)
    bias = bool(config.get("attention_bias", False))
    qkv_bias, out_bias = arch.biases or (bias, bias)
    sizes |= {"qk_norm": arch.qk_norm, "qkv_bias": qkv_bias, "out_bias": out_bias}
    DecoderConfig(
        context=1, **sizes
    )  # sizes no decoder has (more experts per token than experts): now, not later
    return sizes


def _architecture_named(config: dict[str, Any]) -> Architecture:
    """The entry of `ARCHITECTURES` config.json names; a one-line ConfigError for any other."""
    archs = config.get("architectures") or [config.get("model_type", "")]
    arch = archs[0] if archs else ""
    if arch not in ARCHITECTURES:
        raise _fault(
            f"config.json: architectures={arch} is not a decoder torchkiln loads; "
            f"valid: {', '.join(ARCHITECTURES)}",
            "architectures",
            arch,
            tuple(ARCHITECTURES),
        )
    return ARCHITECTURES[arch]


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded folder or the one file's header."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = {}
        for name, shard in weight_map.items():
            file = (folder / shard).resolve()
            if file.parent != folder.resolve() or not file.is_file():  # a shard is a file of this folder
                raise _fault(
                    f"{INDEX_FILE} names {shard}, not a file in {folder}", name, shard, (SINGLE_FILE,)
                )
            files[name] = file
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        found = sorted(
            p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors")
        )
        raise _fault(
            f"model.weights={folder} has no {SINGLE_FILE} or {INDEX_FILE} "
            f"(found: {', '.join(found) or 'none'}); only safetensors are read",
            "model.weights",
            folder,
            (SINGLE_FILE, INDEX_FILE),
        )
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face name -> our parameter for every tensor a folder of `model` holds (a tied head: none;
    LoRA adapters: none, a folder holds the base model)."""
    out = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or is_adapter(name):  # the tied head: the embedding already stands for it
            continue
        seen.add(id(p))
        name = hf_name(name)
        if _EXPERTS.search(name):
            out |= _expert_slices(name, p)
        else:
            out[name] = p
    return out


def _expert_slices(name: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hugging Face name -> expert e's weight, the view `stacked[e]` of a stacked (E, out, in) parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(stacked, DTensor):
        # indexing a sharded DTensor gathers a copy: a load would write into it, not into the shards
        raise _fault(
            f"{name}: a mixture-of-experts folder loads into a whole model, not into FSDP/TP shards (yet); "
            "run it on one process, or with trainer.parallel=ddp",
            "model.weights",
            name,
            ("one process", "trainer.parallel=ddp"),
        )
    base, part = name.rsplit(".", 1)
    return {f"{base}.{e}.{part}_proj.weight": stacked[e] for e in range(len(stacked))}


# Buffers some older checkpoints saved beside the weights; recomputed from the config, so skipped.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


@torch.no_grad()
def load_folder(model: nn.Module, folder: HFFolder, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Copy the folder's tensors into `model` (built to `folder.sizes`; `tensors`: Hugging Face name ->
    parameter where not `expected_tensors(model)`'s); ConfigError naming the first tensor missing, of another
    shape, or not in the model. A parameter that is a DTensor (the model sharded by
    FSDP2 or tensor parallel, e.g. built on the meta device and materialised with `to_empty`) gets only its
    rank's shard, read as a slice of the file: no rank ever holds the whole tensor."""
    from safetensors import safe_open

    want = _checked_tensors(model, folder, tensors)
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(folder.files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in names:
                param = want[name]
                sliced = f.get_slice(name)
                shape = tuple(sliced.get_shape())
                if shape != tuple(param.shape):
                    raise _fault(
                        f"model.weights={folder.path}: the tensor {name} is {shape}, "
                        f"the model's {tuple(param.shape)}",
                        name,
                        shape,
                        (str(tuple(param.shape)),),
                    )
                local, index = local_shard(param)
                local.copy_(sliced[index] if index is not None else f.get_tensor(name))


def _checked_tensors(
    model: nn.Module, folder: HFFolder, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """`tensors` (default: `expected_tensors(model)`), the folder checked to hold each and nothing else."""
    want = expected_tensors(model) if tensors is None else tensors
    tied = model.head.weight is model.tok_emb.weight
    for name, param in want.items():
        if name not in folder.files:
            raise _fault(
                f"model.weights={folder.path}: the tensor {name} is missing",
                name,
                "missing",
                (str(tuple(param.shape)),),
            )
    extra = [n for n in folder.files if n not in want and not _IGNORED.search(n)]
    extra = [n for n in extra if not (tied and n == "lm_head.weight")]  # a tied head saved anyway
    if extra:
        raise _fault(
            f"model.weights={folder.path}: the tensor {extra[0]} has no place in the model",
            extra[0],
            "unexpected",
            ("absent",),
        )
    return want


def architecture_of(model: nn.Module, base: dict[str, Any] | None = None) -> Architecture:
    """The Hugging Face class a model of these options is: the one `base` (a config.json) names where it
    fits, else the first of `ARCHITECTURES` that does; ConfigError for a mix none of them has."""
    c = model.config
    fits = [a for a in ARCHITECTURES.values() if a.fits(c)]
    if not fits:
        raise _fault(
            f"no Hugging Face decoder has qk_norm={c.qk_norm}, qkv_bias={c.qkv_bias}, out_bias={c.out_bias}",
            "out_bias",
            c.out_bias,
            (str(c.qkv_bias),),
        )
    named = (base or {}).get("architectures") or []
    return next((a for a in fits if a.name in named), fits[0])


def config_for(model: nn.Module, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A transformers config.json for `model`: `base` (the folder it was loaded from, keeping its token
    ids and other keys) with every size replaced by the model's (`KEYS`)."""
    c = model.config
    arch = architecture_of(model, base)
    rope = {"rope_theta": c.rope_theta, "rope_type": "llama3" if c.rope_factor else "default"}
    if c.rope_factor:
        rope |= {k.hf: getattr(c, k.ours) for k in KEYS if k.place == "llama3"}
    # transformers 4's spellings of what is rewritten below: left in, they would contradict it
    stale = ("rope_scaling", "rope_theta", "torch_dtype", "num_local_experts")
    config = {k: v for k, v in (base or {}).items() if k not in stale}
    config |= {k.hf: getattr(c, k.ours) for k in KEYS + arch.keys if k.place == "config"}
    config |= {k: valid[0] for k, valid in (REQUIRED | arch.requires).items()}
    config |= {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "rope_parameters": rope,
        "dtype": str(model.tok_emb.weight.dtype).removeprefix("torch."),
    }
    config.setdefault("max_position_embeddings", model.context)
    if arch.biases is None:
        config["attention_bias"] = c.qkv_bias
    return config


def write_folder(model: nn.Module, path: str | Path, *, base_config: dict[str, Any] | None = None) -> Path:
    """Write `model` as a Hugging Face folder: config.json and model.safetensors under transformers' tensor
    names, loadable by `transformers.AutoModelForCausalLM.from_pretrained` and by `read_folder`."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = config_for(model, base_config if base_config is not None else getattr(model, "hf_config", None))
    # an expert's weight is a view of its layer's stacked tensor: cloned (safetensors stores no shared memory)
    tensors = {
        name: p.detach().cpu().clone() if p._base is not None else p.detach().contiguous().cpu()
        for name, p in expected_tensors(model).items()
    }
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    (folder / INDEX_FILE).unlink(missing_ok=True)  # a stale index would point readers at old shards
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


ADAPTER_CONFIG, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"


def write_adapter(model: nn.Module, path: str | Path, *, base: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (core.nn.lora) as a peft adapter folder: adapter_config.json and
    adapter_model.safetensors under Hugging Face's module names, loadable by `peft.PeftModel.from_pretrained`
    onto the base model `base` names (a folder or hub id; null: the caller supplies it)."""
    from safetensors.torch import save_file

    from core.nn.lora import adapter_state, lora_modules

    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters (trainer.lora.rank=0)")
    first = next(iter(modules.values()))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in adapter_state(model, hf_module_name).items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": dropout,
        # the leaf names, as peft users list them: each matches the adapted modules of every layer
        "target_modules": sorted({hf_module_name(n).rpartition(".")[2] for n in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (folder / ADAPTER_CONFIG).write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return folder


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> None:
    """Copy a peft adapter folder's tensors into `model`'s LoRA adapters (applied with the same targets and
    rank); ConfigError naming the folder when its tensors are not exactly the model's adapters."""
    from safetensors.torch import load_file

    from core.nn.lora import adapter_state

    file = Path(path) / ADAPTER_FILE
    tensors = load_file(str(file))
    own = adapter_state(model, hf_module_name)
    if tensors.keys() != own.keys() or any(tensors[k].shape != own[k].shape for k in own):
        missing = sorted(own.keys() - tensors.keys()) or sorted(tensors.keys() - own.keys())
        raise _fault(
            f"{file} does not hold this model's LoRA adapters (same trainer.lora targets and rank?)",
            key="trainer.lora",
            value=str(file),
            valid=tuple(missing[:3]) or ("the model's adapter shapes",),
        )
    for k, t in own.items():
        t.copy_(tensors[k])
