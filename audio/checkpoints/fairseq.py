"""fairseq checkpoints of wav2vec 2.0 and HuBERT (and microsoft/unilm's WavLM), read with weights_only=True:
the sizes their `cfg` or `args` give, and their keys in torchaudio's layout (torchaudio's own fairseq map)."""

from __future__ import annotations

import ast
import re
from typing import Any

from torchaudio.models.wav2vec2.utils.import_fairseq import _map_key


def configs(raw: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the model's and the task's settings, as dicts) of a fairseq checkpoint: `cfg` (fairseq >= 0.10,
    saved as plain containers; microsoft/unilm's WavLM keeps the model's settings at its top), else the older
    `args` Namespace; a fine-tuned model's own are its pretraining's, under w2v_args. None: neither."""

    def plain(x: Any) -> dict[str, Any]:
        return x if isinstance(x, dict) else dict(vars(x)) if hasattr(x, "__dict__") else {}

    cfg, args = raw.get("cfg"), raw.get("args")
    if isinstance(cfg, dict):
        model = plain(cfg.get("model")) or (cfg if "encoder_embed_dim" in cfg else {})
        task = plain(cfg.get("task"))
    else:
        model = task = plain(args)
    inner = model.get("w2v_args")
    if inner is not None:  # a fine-tuned model: its encoder's sizes are the pretrained model's
        inner = plain(inner)
        model, task = plain(inner.get("model")) or inner, plain(inner.get("task")) or inner
    return (model if "encoder_embed_dim" in model else None), task


def arch(model: dict[str, Any]) -> str:
    """wav2vec2, hubert or wavlm, as a fairseq config names it ('' when it does not say)."""
    if model.get("relative_position_embedding"):
        return "wavlm"
    name = str(model.get("_name", model.get("arch", "")))
    return next((a for a in ("hubert", "wav2vec2") if name.startswith(a[:7])), "")


def sizes(model: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
    """The sizes in a fairseq model config (the names of fairseq's Wav2Vec2Config and HubertConfig, and of
    unilm's WavLMConfig)."""
    names = {
        "encoder_embed_dim": "dim",
        "encoder_layers": "layers",
        "encoder_attention_heads": "heads",
        "encoder_ffn_embed_dim": "ff_dim",
        "conv_bias": "conv_bias",
        "conv_pos": "pos_conv_kernel",
        "conv_pos_groups": "pos_conv_groups",
        "layer_norm_first": "layer_norm_first",
        "num_buckets": "num_buckets",
        "max_distance": "max_distance",
    }
    sizes = {ours: model[theirs] for theirs, ours in names.items() if theirs in model}
    if "extractor_mode" in model:  # fairseq's "default" is the group-norm feature encoder
        sizes["extractor_mode"] = "layer_norm" if model["extractor_mode"] == "layer_norm" else "group_norm"
    if "conv_feature_layers" in model:
        sizes["conv_layers"] = conv_layers_literal(str(model["conv_feature_layers"]))
    if "normalize" in task:
        sizes["normalize_audio"] = task["normalize"]
    return sizes


def conv_layers_literal(text: str) -> Any:
    """fairseq's conv_feature_layers, a Python expression of lists of (channels, kernel, stride) tuples
    joined by + and repeated by * (e.g. "[(512, 10, 5)] + [(512, 3, 2)] * 4"), evaluated without running
    it: only literals, + and * are read; anything else gives None (then refused by the checks)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(type(node).__name__)

    try:
        layers = value(ast.parse(text, mode="eval").body)
        return tuple(tuple(int(x) for x in layer) for layer in layers)
    except (SyntaxError, ValueError, TypeError):
        return None


def encoder_key(key: str) -> str:
    """A fairseq (or microsoft/unilm WavLM) key in torchaudio's layout, before WavLM's q/k/v are joined."""
    # unilm's WavLM attention extras, which torchaudio's fairseq map (wav2vec2/HuBERT only) does not know
    wavlm = re.match(
        r"encoder\.layers\.(\d+)\.self_attn\.(relative_attention_bias|grep_linear|grep_a)(.*)", key
    )
    if wavlm:
        name = {"relative_attention_bias": "rel_attn_embed", "grep_linear": "gru_rel_pos_linear"}
        i, part, rest = wavlm.groups()
        return f"encoder.transformer.layers.{i}.attention.{name.get(part, 'gru_rel_pos_const')}{rest}"
    try:
        return _map_key(key) or key
    except ValueError:  # a key torchaudio's map does not know: reported as unknown by the strict check
        return key
