"""Eager vs full vs regional torch.compile: cold/warm compile seconds and steady training-step time.

    PYTHONPATH=. python -m bench.compile [--models transformer8,conformer_conv] [--steps 20] [--threads 1]
    PYTHONPATH=. python -m bench.compile --models transformer8,transformer12 --policies full,regional
    PYTHONPATH=. python -m bench.compile --models lm_gpt --autocast bf16 --threads 2   # as +task=lm runs

`lm_gpt`, `asr_conformer_xs`, `text_encoder` and `small_cnn` are the recipes' own default models at their
recipes' batch shapes; `transformer*` and `conformer_conv` are stand-ins built here.

Every (model, policy) compiles in a fresh process, cold (a cache dir with no kernel of this model) and then
warm (a second process on the same cache dir), so start-up costs are what a user sees; "artif s" is a third
process in a fresh copy of the toolchain dir that first loads the compile artifacts the cold process saved,
as a run resumed from a checkpoint on another node or cache dir does. "Cold" starts from a
primed toolchain by default: Inductor's first compile on a machine probes which vector ISAs g++ can build
and load (about 15 s of g++ runs here) and caches the answer in the compile cache dir, which torchkiln keeps
across runs and models, so a user pays it once per machine and cache, not per model. The bench pays it once,
in a trivial compile it reports as "toolchain s", and copies that cache dir for every cold run;
`--toolchain cold` starts every cold run from an empty dir instead (the first-ever compile on a machine).
Steady-state speed is measured inside the warm process by alternating compiled and eager steps on two copies
of the model, which keeps machine-load drift out of the ratio. `auto` runs last on the warm cache and reports
what it chose. Add models to CASES.
"cold cpu" is the CPU time of the worker's own process only: Inductor's C++ builds run in compile
subprocesses and are not in it. Cold and warm seconds start after the compiler's Python modules are
imported (torch._dynamo, Inductor: 1-2 s per process, paid cold and warm alike, like `import torch`), which
the "import s" column reports from the warm process.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core import compile as kc
from core.nn.transformer import Block  # the block the GPT, text encoder and ViT share
from text.tokenizer import ByteTokenizer


@dataclass
class Case:
    """A model and a training batch for it; `loss(model, batch)` is the scalar one step backpropagates."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]


class TransformerLM(nn.Module):
    """A small causal LM: embedding, `depth` blocks, tied-free head."""

    def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, depth: int = 8, ctx: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout=0.0, bias=True) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, causal=True)
        return self.head(self.norm(x))


class ConformerConvBlock(nn.Module):
    """Conformer-style block without attention: half-step FF, convolution module, half-step FF.

    Almost all of it is elementwise (SiLU, GLU, norms, residual scaling) around thin convolutions, the kind
    of code where Inductor's fusion can beat eager even on a CPU.
    """

    def __init__(self, d: int, kernel: int = 15) -> None:
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.conv_norm = nn.LayerNorm(d)
        self.pw1, self.pw2 = nn.Conv1d(d, 2 * d, 1), nn.Conv1d(d, d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn, self.out_norm = nn.BatchNorm1d(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        h = self.conv_norm(x).transpose(1, 2)
        h = self.pw2(F.silu(self.bn(self.dw(F.glu(self.pw1(h), dim=1)))))
        x = x + h.transpose(1, 2)
        return self.out_norm(x + 0.5 * self.ff2(x))


class ConformerConvEncoder(nn.Module):
    """Feature projection, `depth` ConformerConvBlocks, per-frame classifier (CTC-like head)."""

    def __init__(self, feats: int = 80, d: int = 144, depth: int = 4, classes: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.blocks = nn.ModuleList(ConformerConvBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lm_batch(device: torch.device, ctx: int = 64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (8, ctx + 1), generator=g)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


_lm_batch_128 = functools.partial(_lm_batch, ctx=128)


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def _asr_batch(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 128, 80, generator=g).to(device), torch.randint(0, 32, (8, 128), generator=g).to(
        device
    )


def _registered(name: str, module: str, **kwargs: object) -> Callable[[], nn.Module]:
    """A builder for model `name`, which importing `module` registers in core.registry.MODELS."""

    def build() -> nn.Module:
        # only the domain the case needs: a GPU image without the audio stack still runs the text cases
        importlib.import_module(module)
        from core.registry import MODELS

        return MODELS.build(name, **kwargs)

    return build


# ---- the recipes' own default models at their recipes' batch shapes (conf/task/*.yaml, conf/model/*.yaml)


def _gpt_batch(device: torch.device) -> tuple[torch.Tensor, ...]:
    """32 packed rows of 128 byte tokens (+task=lm) over documents of 100-4,000 tokens, packed as there."""
    from text.lm_data import PackedChunks

    g = torch.Generator().manual_seed(0)
    docs = [
        torch.randint(0, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(100, 4000, (8,), generator=g)
    ]
    chunks = PackedChunks(docs, 128, ByteTokenizer.eos_id)
    x, y, d = (torch.stack(t) for t in zip(*(chunks[i] for i in range(32)), strict=True))
    return x.to(device), y.to(device), d.to(device)


def _task_loss(name: str, module: str, **kwargs: object) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The loss of task `name`'s own `step` (registered by importing `module`), so the bench times exactly
    what the recipe trains; the task is built on first use, and reads no data for `step`."""
    task = None

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        nonlocal task
        if task is None:
            importlib.import_module(module)
            from core.registry import TASKS

            task = TASKS.build(name, **kwargs)
        return task.step(model, batch).loss

    return loss


def _conformer_batch(device: torch.device) -> dict[str, torch.Tensor]:
    """16 log-mel utterances padded to a 152-frame bucket (experiment=asr_conformer), lengths 100-152."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 153, (16,), generator=g)
    lengths[0] = 152
    targets = torch.randint(1, 29, (16, 12), generator=g)
    target_lengths = torch.randint(4, 13, (16,), generator=g)
    feats = torch.randn(16, 152, 80, generator=g)
    batch = {
        "features": feats,
        "feature_lengths": lengths,
        "targets": targets,
        "target_lengths": target_lengths,
    }
    return {k: t.to(device) for k, t in batch.items()}


def _text_batch(device: torch.device) -> dict[str, torch.Tensor]:
    """64 BPE-token texts of 20-128 tokens right-padded with their mask (+task=text_classification)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 129, (64,), generator=g)
    lengths[0] = 128
    mask = torch.arange(128)[None, :] < lengths[:, None]
    tokens = torch.randint(1, 16384, (64, 128), generator=g).masked_fill(~mask, 0)
    labels = torch.randint(0, 8, (64,), generator=g)
    return {"tokens": tokens.to(device), "mask": mask.to(device), "labels": labels.to(device)}


def _digits_batch(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(
        device
    )


#: the recipes' own losses: each task's `step` (the digits task's for the image models)
_gpt_loss = _task_loss("lm", "text.lm", model={"name": "gpt"}, data={"name": "kjv"}, context=128)
_ctc_loss = _task_loss(
    "asr", "audio.asr", model={"name": "conformer_ctc_xs"}, data={"name": "espeak_words"}, decoder="greedy"
)
_text_loss = _task_loss(
    "text_classification", "text.classification", model={"name": "text_encoder"}, data={"name": "kjv_groups"}
)
_cls_loss = _task_loss(
    "image_classification", "vision.classification", model={"name": "small_cnn"}, data={"name": "digits"}
)


#: name -> case; the vision entries are the image_classification task's models at its digits shapes
CASES: dict[str, Case] = {
    "transformer8": Case(TransformerLM, _lm_batch, _lm_loss),
    # 8 blocks at the width where regional and full compile step equally fast (transformer8's d=128 is so
    # small that the whole graph's cross-block fusion wins 7-20%): d=256, 4 heads, context 128, batch 8
    "transformer8w": Case(lambda: TransformerLM(d=256, depth=8, ctx=128), _lm_batch_128, _lm_loss),
    # GPT-2 small's depth at a CPU-sized width: 12 blocks d=256, 4 heads, context 128, batch 8
    "transformer12": Case(lambda: TransformerLM(d=256, depth=12, ctx=128), _lm_batch_128, _lm_loss),
    "transformer16": Case(lambda: TransformerLM(d=256, depth=16, ctx=128), _lm_batch_128, _lm_loss),
    "conformer_conv": Case(ConformerConvEncoder, _asr_batch, _lm_loss),
    # each recipe's default model as its recipe configures it (transformer* and conformer_conv above are
    # stand-ins built here; the image recipe's small_cnn follows)
    "lm_gpt": Case(
        _registered("gpt", "text.gpt", vocab_size=ByteTokenizer.vocab_size, context=128),
        _gpt_batch,
        _gpt_loss,
    ),
    "asr_conformer_xs": Case(
        _registered("conformer_ctc_xs", "audio.conformer", dropout=0.0), _conformer_batch, _ctc_loss
    ),
    "text_encoder": Case(
        _registered(
            "text_encoder",
            "text.models",
            vocab_size=16384,
            num_classes=8,
            max_len=128,
            n_layer=1,
            dropout=0.3,
        ),
        _text_batch,
        _text_loss,
    ),
    "small_cnn": Case(
        _registered("small_cnn", "vision.models", num_classes=10, in_channels=1, image_size=8),
        _digits_batch,
        _cls_loss,
    ),
    "vit": Case(
        _registered("vit", "vision.models", num_classes=10, in_channels=1, image_size=8),
        _digits_batch,
        _cls_loss,
    ),
}


# ----------------------------------------------------------------------------------------------- worker


#: --autocast: the training step's autocast dtype (none = fp32), as the recipes' precision setting picks it
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _worker(
    case_name: str,
    policy: str,
    cache: str,
    steps: int,
    device: str,
    backend: str,
    autocast: str = "none",
    artifacts: str = "",
) -> dict[str, float | str]:
    """One process: build, compile per `policy`, time the first step (compile) and steady steps.

    With `artifacts` (a file path), the first process saves its compile artifacts there after the first
    step, as the trainer does beside a checkpoint; once the file exists, later processes load it before
    compiling, as a resumed run does."""
    if case_name == TOOLCHAIN:
        return _prime_toolchain(cache, device, backend)
    case, dev, dtype = CASES[case_name], torch.device(device), AUTOCAST[autocast]
    torch.manual_seed(0)
    model = case.build().to(dev)
    eager = copy.deepcopy(model)
    batch = case.batch(dev)

    def step(m: nn.Module) -> None:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = case.loss(m, batch)
        loss.backward()
        m.zero_grad(set_to_none=True)

    cfg = kc.CompileConfig(policy=policy if policy != "eager" else "off", cache_dir=cache)
    out = _compile_and_first_step(model, cfg, policy, backend, step, artifacts)
    if steps == 0:
        return out
    for _ in range(2):
        step(model), step(eager)
    ours, ref = [], []
    for _ in range(steps):  # alternate so load changes on the shared machine hit both alike
        ours.append(_timed_ms(step, model, dev))
        ref.append(_timed_ms(step, eager, dev))
    out["step_ms"], out["eager_ms"] = statistics.median(ours), statistics.median(ref)
    return out


def _compile_and_first_step(
    model: nn.Module,
    cfg: kc.CompileConfig,
    policy: str,
    backend: str,
    step: Callable[[nn.Module], None],
    artifacts: str,
) -> dict[str, float | str]:
    """Compile `model` per `cfg` (loading or saving `artifacts`, see _worker) and take its first step: the
    compile's wall and CPU seconds, the compiler's import seconds, what was compiled and the metrics."""
    t_import = time.perf_counter()
    if backend == "inductor":
        # the compiler's own Python modules (1-2 s): a per-process cost like `import torch`, reported apart
        for module in ("torch._dynamo", "torch._inductor.compile_fx"):
            importlib.import_module(module)
    import_s = time.perf_counter() - t_import
    cpu0, wall0 = time.process_time(), time.perf_counter()
    save_artifacts = bool(artifacts) and not os.path.exists(artifacts)
    if artifacts and not save_artifacts:
        kc.load_artifacts(artifacts, cfg)
    kc.apply(model, cfg, probe=step if policy == "auto" else None, backend=backend)
    step(model)  # the first call compiles (auto already compiled and timed inside apply)
    out: dict[str, float | str] = {
        "first_s": time.perf_counter() - wall0,
        "import_s": import_s,
        "first_cpu_s": time.process_time() - cpu0,
        "compiled": model.compile_report.compiled,
        **kc.compile_metrics(),
    }
    if save_artifacts:
        kc.save_artifacts(artifacts, cfg)
    return out


def _timed_ms(step: Callable[[nn.Module], None], m: nn.Module, dev: torch.device) -> float:
    """Milliseconds of one `step(m)`, the device synchronised on both sides."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(m)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


TOOLCHAIN = "toolchain"  # the worker's model name for the per-machine priming compile


def _prime_toolchain(cache: str, device: str, backend: str) -> dict[str, float | str]:
    """Compile a trivial function forward and backward into `cache`: the per-machine first-compile costs."""
    kc.configure_cache(kc.CompileConfig(cache_dir=cache))
    fn = torch.compile(lambda x: torch.relu(torch.sin(x) * 2), backend=backend)
    x = torch.randn(64, device=device, requires_grad=True)
    t = time.perf_counter()
    fn(x).sum().backward()
    return {"first_s": time.perf_counter() - t}


def _run_worker(
    case: str,
    policy: str,
    cache: str,
    args: argparse.Namespace,
    artifacts: str = "",
    steps: int | None = None,
) -> dict[str, float | str]:
    steps = args.steps if steps is None else steps
    cmd = [sys.executable, "-m", "bench.compile", "--worker", case, policy, cache, "--steps", str(steps)]
    cmd += ["--device", args.device, "--threads", str(args.threads), "--backend", args.backend]
    cmd += ["--autocast", args.autocast, "--artifacts", artifacts]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{case}/{policy} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(x: float | str, spec: str) -> str:
    return format(x, spec) if isinstance(x, float) and not math.isnan(x) else str(x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CASES), help=f"comma-separated; known: {', '.join(CASES)}")
    p.add_argument("--policies", default="eager,full,regional,auto")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side in each process")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--backend", default="inductor", help="torch.compile backend (eager: a quick plumbing check)"
    )
    p.add_argument(
        "--autocast",
        choices=tuple(AUTOCAST),
        default="none",
        help="autocast dtype of the training step (bf16: what the recipes run on AMX CPUs and GPUs)",
    )
    p.add_argument(
        "--toolchain",
        choices=("primed", "cold"),
        default="primed",
        help="cold runs start from a cache primed by a trivial compile (primed) or from an empty dir (cold)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="after the table, N more back-to-back cold compiles of full then regional per model, each "
        "from a fresh copy of the toolchain: each pair's regional/full ratio and their median (host "
        "drift moves both runs of a pair alike)",
    )
    p.add_argument(
        "--resumed",
        choices=("on", "off"),
        default="on",
        help="the 'artif s' column: one more process per compiled policy, in a fresh cache dir that loads "
        "the cold run's compile artifacts (off saves that time, e.g. on a short GPU lease)",
    )
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "POLICY", "CACHE"), help=argparse.SUPPRESS)
    p.add_argument("--artifacts", default="", help=argparse.SUPPRESS)
    return p


def main() -> None:
    """Run every (model, policy) cold then warm in fresh processes and print one side-by-side table."""
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        out = _worker(*args.worker, args.steps, args.device, args.backend, args.autocast, args.artifacts)
        print(json.dumps(out))
        return
    print(
        f"torch {torch.__version__}, device {args.device}, backend {args.backend}, autocast {args.autocast}, "
        f"{args.threads} thread(s), {args.steps} steps/side"
    )
    head = (
        f"{'model':<15} {'policy':<9} {'cold s':>8} {'cold cpu':>8} {'warm s':>7} {'warm/cold':>9} "
        f"{'artif s':>7} {'cold/full':>9} {'import s':>8} {'step ms':>8} {'eager ms':>8} {'speedup':>7} "
        f"{'recomp':>6}  chose"
    )
    names = args.models.split(",")
    for name in names:
        if name not in CASES:
            raise SystemExit(f"--models: unknown model {name!r}; known: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-toolchain-") as toolchain:
        if args.toolchain == "primed":
            once = float(_run_worker(TOOLCHAIN, "full", toolchain, args)["first_s"])
            print(f"toolchain s {once:.1f} (trivial compile into an empty cache dir: paid once per machine "
                  "and cache dir; every cold run below starts from a copy of it)")  # fmt: skip
        print(head)
        primed = toolchain if args.toolchain == "primed" else None
        for name in names:
            _bench_model(name, args, primed)
        for name in names if args.pairs > 0 else ():
            _cold_pairs(name, args, primed)


def _cold_pairs(name: str, args: argparse.Namespace, toolchain: str | None) -> list[float]:
    """Print `args.pairs` back-to-back (full, regional) cold compiles of `name` and the median ratio; return
    each pair's regional/full ratio."""
    ratios = []
    for i in range(args.pairs):
        secs = {}
        with tempfile.TemporaryDirectory(prefix=f"kiln-bench-pair-{name}-") as tmp:
            for policy in ("full", "regional"):
                cache = os.path.join(tmp, policy)
                if toolchain:
                    shutil.copytree(toolchain, cache)
                secs[policy] = float(_run_worker(name, policy, cache, args)["first_s"])
        ratios.append(secs["regional"] / secs["full"])
        print(
            f"{name} cold pair {i + 1}: full {secs['full']:.1f} s, regional {secs['regional']:.1f} s, "
            f"regional/full {ratios[-1]:.2f}",
            flush=True,
        )
    print(f"{name} regional/full cold over {args.pairs} pairs: median {statistics.median(ratios):.2f}")
    return ratios


def _bench_model(name: str, args: argparse.Namespace, toolchain: str | None) -> dict[str, dict[str, Any]]:
    """Print one row per policy for model `name`; cold caches start as copies of `toolchain` when given.
    Returns each policy's worker results: "cold", "warm" and "resumed" (None where not run)."""
    full_cold = float("nan")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=f"kiln-bench-{name}-") as tmp:
        for policy in args.policies.split(","):
            # auto reuses the cache of what it compiles on this device, as a repeated run would
            auto_kind = kc.default_auto_candidates(torch.device(args.device).type)[0]
            cache = os.path.join(tmp, auto_kind if policy == "auto" else policy)
            if toolchain and not os.path.exists(cache):
                shutil.copytree(toolchain, cache)
            compiled_here = policy not in ("eager", "auto")
            resumed = compiled_here and args.resumed == "on"
            art = os.path.join(tmp, f"{policy}.artifacts") if resumed else ""
            cold = _run_worker(name, policy, cache, args, art) if compiled_here else None
            warm = _run_worker(name, policy, cache, args)
            moved = None
            if resumed:  # a resumed run in a fresh cache dir: only the saved artifacts can warm it
                fresh = os.path.join(tmp, f"{policy}-resumed")
                if toolchain:
                    shutil.copytree(toolchain, fresh)
                moved = _run_worker(name, policy, fresh, args, art, steps=0)
            if policy == "full" and cold:
                full_cold = float(cold["first_s"])
            c = cold or warm
            row = [
                f"{name:<15} {policy:<9}",
                f"{_fmt(float(c['first_s']), '8.1f') if cold else '-':>8}",
                f"{_fmt(float(c['first_cpu_s']), '8.1f') if cold else '-':>8}",
                f"{float(warm['first_s']):7.1f}",
                f"{float(warm['first_s']) / float(c['first_s']):9.2f}" if cold else f"{'-':>9}",
                f"{float(moved['first_s']):7.1f}" if moved else f"{'-':>7}",
                f"{float(c['first_s']) / full_cold:9.2f}" if cold and policy == "regional" else f"{'-':>9}",
                f"{float(warm['import_s']):8.1f}",
                f"{float(warm['step_ms']):8.2f}",
                f"{float(warm['eager_ms']):8.2f}",
                f"{float(warm['eager_ms']) / float(warm['step_ms']):7.2f}",
                f"{int(float(c.get('compile/recompiles', 0))):>6}",
                f" {warm['compiled']}",
            ]
            print(" ".join(row), flush=True)
            results[policy] = {"cold": cold, "warm": warm, "resumed": moved}
    return results


if __name__ == "__main__":
    main()
