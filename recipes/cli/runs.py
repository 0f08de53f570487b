"""A training run loaded back (its config, task, weights file and device plan) for what comes after
training (eval, predict, generate, transcribe, export).

`ckpt=` names a run directory (its exported `model.safetensors`: the best checkpoint's weights by default;
else its newest complete checkpoint) or one `checkpoints/step_*` folder. The task is rebuilt from the run's
saved `.hydra/config.yaml` (plain values only: `recipes.cli.tasks.load_run_config`), so tokenizers, word lists
and model settings are the ones the model was trained with; weights load with `weights_only=True` or
safetensors. `ckpt=` may also name a Hugging Face decoder folder (config.json beside safetensors): it
loads as the `+task=lm model=llama model.weights=DIR tokenizer=pretrained` run it would start
(`hf_run_config`). The model runs under the run's own device plan (its device and precision settings,
resolved on this machine as `recipes.train` resolves them; precision=auto on a CPU as the precision the run
trained in, which its model probe chose), so evaluation reproduces the loop's numbers.
`data.KEY=VALUE` and `task.KEY=VALUE` overrides change the saved config, checked against the schema its
data or task builder derives (`recipes.cli.config`), as `recipes.train` checks its command line.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

import audio  # noqa: F401  (registers the tasks a saved config may name)
import text  # noqa: F401
import vision  # noqa: F401
from core import checkpoint
from core.bounds import check_values
from core.checkpoint.layout import read_meta
from core.device import DevicePlan, model_precision, resolve
from core.errors import CheckpointError, ConfigError
from core.loop.task import Task
from core.nn.lora import LoRAConfig, apply_lora
from core.registry import DATASETS, TASKS
from recipes.cli.config import schema_from_builder
from recipes.cli.errors import one_line
from recipes.cli.tasks import build_task, load_run_config
from text.checkpoints.hf import INDEX_FILE, SINGLE_FILE, read_folder

#: the sections of a saved config a command line may override, with their registries and the task's
#: keywords that are sections of their own
OVERRIDABLE = {"data": (DATASETS, ()), "task": (TASKS, ("model", "data"))}


@dataclass
class Run:
    """A loaded run: where it is, its saved config, its task and its model with the trained weights."""

    run_dir: Path
    cfg: dict[str, Any]
    task: Task
    model: nn.Module
    #: the file or checkpoint folder the weights came from
    weights: Path
    #: the run's device plan on this machine (applied): its device, autocast and threads
    plan: DevicePlan


#: the longest context an HF folder's run is given by default: its rotary tables and KV cache are sized by
#: it, and a config's max_position_embeddings (131,072 for Llama 3.1) would make them large for nothing;
#: eval's task.context=N overrides it
HF_CONTEXT = 4096


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model folder (config.json beside model.safetensors or its index) and
    not a run directory."""
    path = Path(path).expanduser()
    if (path / ".hydra").is_dir():  # a run's own config wins over any config.json a user left beside it
        return False
    return (path / "config.json").is_file() and any((path / f).is_file() for f in (SINGLE_FILE, INDEX_FILE))


def hf_run_config(folder: str | Path, task: str = "lm") -> dict[str, Any]:
    """The config of the lm run an HF folder stands for: model=llama with model.weights=folder, the folder's
    tokenizer.json, the context of its config.json (at most HF_CONTEXT); ConfigError naming the first
    config.json key of an architecture or option torchkiln does not load. `task="sft"`: the chat fine-tune
    it stands for instead, which asks in the folder's chat template."""
    folder = Path(folder).expanduser()
    hf = read_folder(folder)  # checked before any tokenizer or model is built: one line for a foreign folder
    context = int(hf.config.get("max_position_embeddings") or HF_CONTEXT)
    return {
        "task": {"name": task, "tokenizer": "pretrained", "context": min(context, HF_CONTEXT)},
        "model": {"name": "llama", "weights": str(folder)},
        # nothing reads it unless eval is pointed at data (data.KEY=VALUE): the tokenizer is the folder's
        "data": {"name": "chat" if task == "sft" else "kjv"},
        "device": "auto",
        "precision": "auto",
        "seed": 0,
    }


def locate(ckpt: str | Path) -> tuple[Path, Path | None]:
    """(run dir, checkpoint folder or None) for `ckpt`, a run dir or a `checkpoints/step_*` folder."""
    path = Path(ckpt).expanduser()
    if (path / "meta.json").is_file():
        return path.parent.parent, path
    if not (path / ".hydra" / "config.yaml").is_file():
        raise CheckpointError(
            f"ckpt={ckpt}: no .hydra/config.yaml there; give a training run directory (its config and "
            "model.safetensors or checkpoints/), one of its checkpoints/step_* folders or a Hugging Face "
            "model folder (config.json, model.safetensors)",
            key="ckpt",
            value=str(ckpt),
            valid=(
                "a run directory with .hydra/config.yaml",
                "a checkpoints/step_* folder",
                "a Hugging Face model folder",
            ),
        )
    return path, None


def run_config(ckpt: str | Path, hf_task: str = "lm") -> dict[str, Any]:
    """The saved config of the run `ckpt` names (a run directory or one of its checkpoint folders; an HF
    folder: `hf_run_config` of `hf_task`)."""
    if is_hf_folder(ckpt):
        return hf_run_config(ckpt, hf_task)
    return load_run_config(locate(ckpt)[0] / ".hydra" / "config.yaml")


def apply_overrides(cfg: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`cfg` with `data.KEY=VALUE` / `task.KEY=VALUE` overrides (values as on a Hydra command line), each
    section checked against its builder's schema and `Bounds`: an unknown key or a bad value is one
    ConfigError naming it. `data.name=OTHER` starts that section from OTHER's defaults."""
    out = copy.deepcopy(cfg)
    for section, (reg, skip) in OVERRIDABLE.items():
        given = [o for o in overrides if o.startswith(f"{section}.")]
        if not given:
            continue
        try:
            changes = OmegaConf.to_container(OmegaConf.from_dotlist(given), resolve=False)[section]
        except (OmegaConfBaseException, ValueError) as e:
            raise ConfigError(one_line(e)) from None
        saved = dict(out[section])
        name = str(changes.get("name", saved["name"]))
        if name != saved["name"]:
            if section == "task":
                raise ConfigError(f"task.name={name}: a run's task cannot change (it is {saved['name']})")
            saved = {"name": name}
        schema = schema_from_builder(section, name, reg.get(name), skip)
        try:
            base = OmegaConf.create({section: OmegaConf.structured(schema)})
            merged = OmegaConf.merge(base, {section: saved}, {section: changes})
            plain = OmegaConf.to_container(merged, resolve=False)[section]
        except OmegaConfBaseException as e:
            raise ConfigError(one_line(e)) from None
        check_values(section, {k: v for k, v in plain.items() if k not in ("name", *skip)}, reg.get(name))
        out[section] = plain
    return out


def load_run(
    ckpt: str | Path,
    *,
    device: str = "",
    tasks: tuple[str, ...] = (),
    command: str = "",
    overrides: Sequence[str] = (),
    precision: str = "",
    hf_task: str = "lm",
) -> Run:
    """Load the run `ckpt` names in eval mode, under its device plan (`device`: another device than the
    run's setting; `precision`: another than the run's); `overrides` change its saved data/task config
    (`apply_overrides`); `tasks` (if given) are the task names the calling `command` serves, anything else
    is a one-line ConfigError naming the run's task. An HF folder loads as `hf_run_config`'s run of
    `hf_task` (lm, or sft: its chat template)."""
    hf = is_hf_folder(ckpt)
    run_dir, step_dir = (Path(ckpt).expanduser(), None) if hf else locate(ckpt)
    saved = run_config(ckpt, hf_task) if hf else load_run_config(run_dir / ".hydra" / "config.yaml")
    cfg = apply_overrides(saved, overrides)
    name = cfg["task"]["name"]
    if tasks and name not in tasks:
        raise ConfigError(
            f"ckpt={ckpt} is a '{name}' run; {command or 'this command'} serves {', '.join(tasks)} runs"
        )
    spec = device or cfg.get("device", "auto")
    plan = resolve(spec, precision or cfg.get("precision", "auto"), cfg.get("mps_fallback", False))
    plan.apply()
    task = build_task(cfg)
    task.load_artifacts(run_dir)
    model = task.build_model()
    lora = LoRAConfig(**cfg.get("trainer", {}).get("lora", {}))
    # the trained adapters' modules, before their weights load (checkpoints hold those alone)
    apply_lora(model, lora, external_name=getattr(model, "external_name", None))
    exported = run_dir / "model.safetensors"
    if hf:
        source = run_dir  # build_model loaded the folder's tensors (text.pretrained)
    elif step_dir is None and exported.is_file():
        from safetensors.torch import load_model

        try:
            load_model(model, str(exported))
        except (RuntimeError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{exported} does not match the model of its run's config: {first}"
            ) from None
        source = exported
    else:
        source = step_dir or checkpoint.resolve("auto", run_dir)
        if source is None:
            raise CheckpointError(f"ckpt={ckpt}: no model.safetensors and no complete checkpoint in it")
        weights, _, _ = checkpoint.load(source)
        checkpoint.load_model_state(model, weights, source)
    if not hf and not precision and cfg.get("precision", "auto") == "auto":
        plan = as_trained(plan, run_dir, source)
    model = model.to(plan.device).eval()
    return Run(run_dir, cfg, task, model, source, plan)


def as_trained(plan: DevicePlan, run_dir: Path, source: Path) -> DevicePlan:
    """`plan` in the precision run `run_dir` trained in where precision=auto timed its model on a CPU
    (`core.device.model_precision`: the model's pick, which the machine's alone may differ from): from
    checkpoint `source`'s meta.json, or for the exported weights the run's result.json, else its newest
    checkpoint's; unchanged where none says."""
    if not model_precision.available(plan):
        return plan
    unreadable = (OSError, ValueError, AttributeError, CheckpointError)  # then the run's setting stays
    trained = None
    with contextlib.suppress(*unreadable):
        if source.is_dir():
            trained = read_meta(source).get("precision")
        else:
            trained = json.loads((run_dir / "result.json").read_text()).get("precision")
    if trained is None:  # neither said: the newest checkpoint's record, where there is one
        newest = checkpoint.resolve("auto", run_dir)
        with contextlib.suppress(*unreadable):
            trained = read_meta(newest).get("precision") if newest is not None else None
    return model_precision.trained_in(plan, trained, run_dir.name) or plan
