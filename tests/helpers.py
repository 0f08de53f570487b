"""What several test files share: the toy Trainer runs, the metrics.jsonl reader, the environment CLI
subprocesses run in, a private small filesystem, the offline W&B reader, the train config composed from
conf/, the tiny text-recipe settings and the recipe runs the after-training tests start from. Fixtures stay
in the conftest.py files; the plain functions and constants live here, so no test file imports another's
private names."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def compose_train(overrides: list[str], *, hydra: bool = False) -> Any:
    """The `train` config `overrides` compose to from the shipped conf/ (with its `hydra` section where
    `hydra`), Hydra's global state cleared before and after."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from recipes.cli.config import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("train", overrides=list(overrides), return_hydra_config=hydra)
    finally:
        GlobalHydra.instance().clear()


def fault(error: BaseException) -> tuple[str | None, str | None, tuple[str, ...]]:
    """A user error's (key, value, valid) fields (core.errors.TorchkilnError): what a test asserts, rather
    than the sentence around them."""
    return getattr(error, "key", None), getattr(error, "value", None), tuple(getattr(error, "valid", ()))


def toy_trainer(
    run_dir: Path,
    *,
    task: Any = None,
    optim: Any = None,
    device: str = "cpu",
    precision: str = "fp32",
    seed: int = 3,
    resume: str | None = None,
    callbacks: Any = (),
    early_stop: Any = None,
    compile_cfg: Any = None,
    model_hook: Any = None,
    **cfg: object,
) -> Any:
    """A core.Trainer of the toy task (tests/core/toy_task.py; its dropout and jitter draw from the RNG), not
    yet fit: batches of 8, no progress bar, `cfg` over that (TrainerConfig's defaults for the rest), `optim`
    (AdamW lr 1e-2 after 2 warm-up steps when None), seed 3. fp32: the plan may pick bf16 autocast on a CPU,
    and the callers compare runs exactly."""
    from core.loop.trainer import Trainer, TrainerConfig
    from core.optim import OptimConfig
    from tests.core.toy_task import ToyTask

    return Trainer(
        task or ToyTask(),
        TrainerConfig(**{"batch_size": 8, "progress": False, **cfg}),
        optim or OptimConfig(lr=1e-2, warmup_steps=2),
        run_dir=run_dir,
        device=device,
        precision=precision,
        seed=seed,
        resume=resume,
        callbacks=list(callbacks),
        early_stop=early_stop,
        compile_cfg=compile_cfg,
        model_hook=model_hook,
    )


#: fit_toy's run: 3 epochs of 5 batches of 8, every step logged, a checkpoint every 2 steps, all kept
TOY_RUN = {"max_epochs": 3, "log_every": 1, "keep_last": 100, "ckpt_every": 2}


def fit_toy(run_dir: Path, **kwargs: Any) -> Any:
    """A finished toy_trainer run of TOY_RUN; `kwargs` (toy_trainer's, TrainerConfig fields among them)
    override it."""
    t = toy_trainer(run_dir, **{**TOY_RUN, **kwargs})
    t.fit()
    return t


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in the order the loop wrote them."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a CLI subprocess of this checkout: no Hydra traceback, unbuffered
    output, no Triton interpreter; `extra` on top."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.update(extra or {})
    return env


def kernel_files(root: Path) -> set[str]:
    """Compiled kernel libraries (*.so) under an Inductor cache dir, as paths relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*.so")}


def artifact_kernels(path: Path) -> set[str]:
    """The kernel libraries a compile-artifacts file carries, as paths relative to the cache dir."""
    import zipfile

    from core.compile.artifacts import KERNELS

    with zipfile.ZipFile(path) as zf:
        return {n[len(KERNELS) :] for n in zf.namelist() if n.startswith(KERNELS) and n.endswith(".so")}


def in_small_filesystem(size: str, *command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `command` with a fresh tmpfs of `size` mounted at tmp_path/fs, in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    mount = tmp_path / "fs"
    mount.mkdir()
    script = f'mount -t tmpfs -o size={size} tmpfs {mount} && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command],
        env={**os.environ, "PYTHONPATH": str(REPO), "MOUNTED": str(mount)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "unshare:" in proc.stderr or "mount:" in proc.stderr:
        pytest.skip(f"a private tmpfs cannot be mounted here: {proc.stderr.strip()[:200]}")
    return proc


def offline_wandb_env(root: Path) -> dict[str, str]:
    """W&B settings for a test: quiet, its config and caches under `root`, and its server a closed port on
    this machine, so anything that tried to go online would fail here instead of reaching the network."""
    return {
        "WANDB_SILENT": "true",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
    }


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)  # W&B sends some keys as a path of parts


def read_wandb_run(path: Path) -> dict[str, Any]:
    """What an offline run's `run-<id>.wandb` file holds: its id and project, config, history rows by step
    and saved files. The file is W&B's record log (LevelDB's log format behind a 7-byte `:W&B` header:
    32 KiB blocks of chunks with a 7-byte header each) of `wandb_internal_pb2.Record`s; wandb 0.31 ships no
    Python reader for it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, header = 32768, 7
    out: dict[str, Any] = {"config": {}, "history": {}, "files": []}
    pos, chunk = header, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        chunk += data[pos + header : pos + header + length]
        pos += header + length
        if kind not in (1, 4):  # FIRST or MIDDLE chunk: the record goes on
            continue
        record, chunk = pb.Record.FromString(chunk), b""
        which = record.WhichOneof("record_type")
        if which == "run":
            out["id"], out["project"] = record.run.run_id, record.run.project
        elif which == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif which == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            out["history"][record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif which == "files":
            out["files"] += [f.path for f in record.files.files]
    return out


TINY_LM = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "task.context=32", "task.val_chunks=4"]


#: a tiny Llama lm run (fp32), whose folder `recipes.export format=hf` writes (tokenizer=bytes or bpe to add)
TINY_RUN = [
    "+task=lm",
    "model=llama",
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.hidden=64",
    "trainer=smoke",
    "trainer.max_steps=2",
    "trainer.batch_size=4",
    "task.context=32",
    "task.val_chunks=4",
    "task.bpe_vocab_size=300",
    "logger=none",
    "precision=fp32",
]


TINY_CLS = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "task.max_len=32"]


def write_table(path: Path, n: int) -> None:
    """A two-class JSONL table a classifier separates from single words."""
    words = {"law": ["statute", "ordinance", "commandment"], "song": ["sing", "praise", "harp"]}
    lines = [
        json.dumps({"text": f"{words[lab][i % 3]} and {words[lab][(i + 1) % 3]}", "label": lab})
        for i in range(n)
        for lab in words
    ]
    path.write_text("\n".join(lines) + "\n")


_PRECISION_FLAGS = (
    lambda t: t.backends.mkldnn.matmul,
    lambda t: t.backends.mkldnn.conv,
    lambda t: t.backends.cuda.matmul,
    lambda t: t.backends.cudnn.conv,
)


@contextlib.contextmanager
def process_state(env: dict[str, str] | None = None, cwd: Path | None = None) -> Iterator[None]:
    """Run a CLI entry point in this process as if it were its own: `env` on top of this environment, `cwd`,
    and afterwards everything a run changes process-wide put back (environment, argv, working directory,
    torch's threads, RNG and precision flags, signal handlers, every logger's handlers and levels, Hydra's
    global state), so the tests after it see the process they had."""
    import torch
    from hydra.core.global_hydra import GlobalHydra

    saved_env, argv, here = dict(os.environ), list(sys.argv), os.getcwd()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    anomaly, dtype = torch.is_anomaly_enabled(), torch.get_default_dtype()
    # the device plan's fp32 precision flags (oneDNN bf16 fast math on Graviton3, TF32 on CUDA), where this
    # torch has them; only where it lacks them the legacy setting (torch >= 2.9 raises when a legacy getter
    # reads a state the per-backend flags set)
    flags = [b for b in _PRECISION_FLAGS if hasattr(b(torch), "fp32_precision")]
    precisions = [b(torch).fp32_precision for b in flags]
    matmul = None if flags else torch.get_float32_matmul_precision()
    signals = {
        s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    }
    os.environ.update(env or {})
    os.environ.update({"HYDRA_FULL_ERROR": "0"})
    if cwd is not None:
        os.chdir(cwd)
    GlobalHydra.instance().clear()
    try:
        with logging_state():
            yield
    finally:
        GlobalHydra.instance().clear()
        for s, h in signals.items():
            signal.signal(s, h)
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        torch.autograd.set_detect_anomaly(anomaly)
        torch.set_default_dtype(dtype)
        for b, value in zip(flags, precisions, strict=True):
            b(torch).fp32_precision = value
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
        os.chdir(here)
        sys.argv[:] = argv
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def logging_state(*, added_only: bool = False) -> Iterator[None]:
    """Every logger's handlers, level, propagate and disabled flag put back afterwards: Hydra's logging config
    adds handlers bound to the streams of the moment (a test's capture) and may disable loggers, and a
    handler left behind writes to a closed capture in a later test ("--- Logging error ---").

    `added_only`: drop the handlers added meanwhile but re-add none that went, and leave pytest's own alone
    (around a whole test, where pytest swaps its capture handlers between setup, call and teardown)."""
    saved = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in _loggers()}
    try:
        yield
    finally:
        for lg in _loggers():
            handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
            for h in list(lg.handlers):
                if h not in handlers and not type(h).__module__.startswith("_pytest"):
                    h.close()
                    lg.removeHandler(h)
            if not added_only:
                lg.handlers[:] = handlers
            lg.level, lg.propagate, lg.disabled = level, propagate, disabled


def _loggers() -> list[logging.Logger]:
    """The root logger and every named one this process has made."""
    named = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger(), *(lg for lg in named if isinstance(lg, logging.Logger))]


def in_process(main: Callable[[list[str]], int], argv: list[str], **state: Any) -> int:
    """`main(argv)` of a CLI module under `process_state(**state)`: its exit code, SystemExit's included."""
    with process_state(**state):
        try:
            return main(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1


def run_here(
    module: str, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV...` as `module.main(argv)` in this process (`in_process`), its stdout and stderr
    captured: the same result object as the subprocess, for tests of what a command computes and writes."""
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = in_process(main, list(argv), env=env, cwd=cwd)
    return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def train(run: Path, overrides: list[str], env: dict[str, str] | None = None) -> Path:
    """`python -m recipes.train OVERRIDES` into `run`, in this process (`in_process`): its callers check
    what a run computes, not the process, and each start saved is ~5 s of imports; the run directory."""
    from recipes import train as recipe

    code = in_process(recipe.main, [*overrides, f"hydra.run.dir={run}"], env=env, cwd=run.parent)
    assert code == 0, f"recipes.train exited {code}"
    return run


def val_row(run: Path, step: int) -> dict[str, float]:
    """The `val/*` metrics the loop logged at `step` (metrics.jsonl)."""
    row = next(r for r in read_metrics(run) if r["step"] == step and any(k.startswith("val/") for k in r))
    return {k: v for k, v in row.items() if k.startswith("val/")}


#: the training script the 2-rank tests launch (tests/core/dist_fit.py)
DIST_FIT = REPO / "tests" / "core" / "dist_fit.py"


def dist_env_vars() -> dict[str, str]:
    """This process's environment for real gloo ranks: one thread each, this checkout on the path, and a
    60 s collective timeout (a rank that hangs instead of failing would hold a test for torch's 10 min)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHKILN_DIST_TIMEOUT": "60"}


def run_dist_fit(
    out: Path, parallel: str, nproc: int, *extra: str, restarts: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """tests/core/dist_fit.py into `out` in one process, or under torchrun's agent with `nproc` ranks (and
    `restarts` elastic restarts); asserts it exits 0."""
    if nproc == 1:
        cmd = [sys.executable, str(DIST_FIT), str(out), parallel, *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += [f"--max-restarts={restarts}", str(DIST_FIT), str(out), parallel, *extra]
    proc = subprocess.run(
        cmd, env={**dist_env_vars(), **(env or {})}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


#: a digits run evaluated at its last step (5), whose model.safetensors is that step's weights
DIGITS = [
    "+task=image_classification",
    "trainer=smoke",
    "model.width=16",
    "trainer.export=last",
    "logger=none",
]
#: the eSpeak corpus and Conformer at the sizes tests/audio/test_asr.py trains
ASR_SIZES = {"train": 8, "val": 2, "test": 2}
ASR = [
    "experiment=asr_conformer",
    "trainer=smoke",
    *(f"data.{s}_size={n}" for s, n in ASR_SIZES.items()),
    "model.dim=64",
    "model.layers=2",
    "model.heads=2",
    "model.subsampling_channels=16",
    "logger=none",
    "precision=fp32",  # the runs the tests compare are fp32 ones, whatever precision=auto measures here
]


@dataclass(frozen=True)
class AsrRun:
    """A finished tiny ASR run, its corpus folder (manifests, wav/) and the environment it ran in."""

    run: Path
    corpus: Path
    env: dict[str, str]


def tone_manifest(folder: Path, n: int, texts: tuple[str, str]) -> Path:
    """n short clips, each a tone whose pitch tells which of the two `texts` it is (a learnable toy for the
    speech models), as a JSONL manifest in `folder`."""
    import soundfile as sf
    import torch

    rows = []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        t = torch.arange(2400 + 400 * (i % 3)) / 16_000
        wav = 0.3 * torch.sin(2 * torch.pi * (300 + 500 * (i % 2)) * t) + 0.01 * torch.randn(
            len(t), generator=g
        )
        sf.write(folder / f"{i}.wav", wav.numpy(), 16_000)
        rows.append(json.dumps({"audio_filepath": f"{i}.wav", "text": texts[i % 2]}))
    path = folder / "m.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def run_bench(module: Any, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m bench.NAME ARGV...` as `module.main()` in this process, torch's thread count restored after
    (its --threads sets it)."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    threads = module.torch.get_num_threads()
    try:
        module.main()
    finally:
        module.torch.set_num_threads(threads)


def killed_and_resumed(
    cmd: list[str], root: Path, step: int, env: dict[str, str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """The kill -9 check of a training command line `cmd` (no hydra.run.dir): run straight into ROOT/a; run
    again into ROOT/b, SIGKILLed as soon as its checkpoint of `step` is written, then resumed there
    (resume=auto); both runs' model.safetensors must hold the same tensors bit for bit. (ROOT/b, the resumed
    run's process.)"""
    import time

    import torch
    from safetensors.torch import load_file

    straight = subprocess.run(
        [*cmd, f"hydra.run.dir={root / 'a'}"], env=env, capture_output=True, timeout=600
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    run = root / "b"
    proc = subprocess.Popen([*cmd, f"hydra.run.dir={run}"], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / f"step_{step:08d}").is_dir() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (run / "model.safetensors").exists()
    resumed = subprocess.run(
        [*cmd, "resume=auto", f"hydra.run.dir={run}"], env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = load_file(root / "a" / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return run, resumed


def launched_losses(run: Path, argv: list[str]) -> dict[int, float]:
    """`python -m recipes.train ARGV` into `run` in a process of its own (it launches its ranks itself with
    dist.nproc_per_node); asserts it exits 0; its `train/loss` by step."""
    cmd = [sys.executable, "-m", "recipes.train", *argv, f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, env=dist_env_vars(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {row["step"]: row["train/loss"] for row in read_metrics(run) if "train/loss" in row}


@contextlib.contextmanager
def counted_compiles(model: Any) -> Iterator[list[int]]:
    """`model` compiled in place with a backend that runs each graph as traced and counts it: yields the
    list that gains an item per graph compiled; dynamo's caches are reset around it."""
    import torch

    compiles: list[int] = []

    def counting(gm: Any, example_inputs: list) -> Any:  # noqa: ARG001
        compiles.append(1)
        return gm.forward

    torch.compiler.reset()
    try:
        model.compile(backend=counting)
        yield compiles
    finally:
        torch.compiler.reset()
