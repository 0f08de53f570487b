"""Scale-out: a model of per-GPU memory and bytes communicated per step (--model), and real two-process runs
of the LM recipe on this CPU (--measure).

    PYTHONPATH=. python -m bench.scaling --model [--gpus 8,64,512] [--micro-batch 1] [--limit-gib 80]
    PYTHONPATH=. python -m bench.scaling --measure [--steps 40] [--batch 32]

`--model` is arithmetic only (no torch), so its table is the same on every host: GPT sizes 125M / 1.3B
(GPT-3 paper shapes) and 7B / 70B (Llama 2 7B / Llama 3 70B, torchtitan's shapes) under DDP, FSDP and
FSDP x TP (TP=8 inside a node), then the same arithmetic at torchtitan's published configurations beside
their measured memory (docs/scaling.md cites them).

`--measure` trains the LM recipe three ways with the same global batch and steps: one process with two
threads, and two one-thread ranks under DDP and under FSDP (gloo, torchrun --standalone), and prints
tokens/s per run and each two-rank run's ratio to the one-process run against the 0.85x goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
GB = 1e9
#: fp32 master parameters, fp32 gradients, AdamW's two fp32 moments: torchtitan's default mixed precision
#: (FSDP2 MixedPrecisionPolicy param_dtype=bf16, reduce_dtype=fp32) keeps all of these in fp32, sharded
STATE_BYTES_PER_PARAM = 4 + 4 + 8
#: the overall goal for two ranks against one process with the same threads in all (issue #16 point 9)
GOAL = 0.85


@dataclass(frozen=True)
class GPTSize:
    """A decoder-only transformer's shape: GPT-2/3 (LayerNorm, GELU MLP of `ffn`, learned positions, tied
    head, biases) or Llama (RMSNorm, SwiGLU MLP of `ffn`, RoPE, grouped-query attention, untied head)."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    ffn: int
    vocab: int
    seq: int
    llama: bool = False
    #: key/value heads (grouped-query attention); 0: as many as query heads
    n_kv_head: int = 0
    source: str = ""

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return (self.n_kv_head or self.n_head) * (self.d_model // self.n_head)

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.d_model, self.ffn
        if self.llama:  # wq, wo; wk, wv; w1, w2, w3; two RMSNorm weights
            return 2 * h * h + 2 * h * self.kv_dim + 3 * h * f + 2 * h
        # qkv and out projections, fc and proj, with biases; two LayerNorms (weight and bias)
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @property
    def embedding_params(self) -> int:
        """The input embedding (and GPT's learned positions)."""
        return self.vocab * self.d_model + (0 if self.llama else self.seq * self.d_model)

    @property
    def output_params(self) -> int:
        """The final norm and the output projection (GPT ties it to the embedding: norm only)."""
        norm = self.d_model if self.llama else 2 * self.d_model
        return norm + (self.vocab * self.d_model if self.llama else 0)

    @property
    def params(self) -> int:
        """All parameters."""
        return self.n_layer * self.block_params + self.embedding_params + self.output_params

    @property
    def act_elems_per_token_layer(self) -> int:
        """16-bit elements one block saves for backward per token, with fused (flash) attention and no
        dropout: Korthikanti et al. 2022's 34*s*b*h bytes for GPT less its dropout masks is 32 (16 elements
        per h); the attention score terms vanish because fused attention recomputes them."""
        h, f = self.d_model, self.ffn
        if self.llama:
            # norm inputs (2h), normed inputs to wqkv and w1/w3 (2h), q (h), k and v (2 kv), attention
            # output (h), w1 and w3 outputs and silu(w1) (3f), the product fed to w2 (f)
            return 6 * h + 2 * self.kv_dim + 4 * f
        # LN inputs (2h), normed inputs to qkv and fc (2h), q, k, v (3h), attention output (h), GELU input
        # and output (2f)
        return 8 * h + 2 * f


#: the table's sizes. 125M and 1.3B: GPT-3 paper (Brown et al. 2020, Table 2.1) shapes with GPT-2's
#: vocabulary (1.3B: 16 heads of 128, as d_model / d_head gives; the paper's table lists 24 heads);
#: 7B and 70B: the shapes torchtitan trains (Llama 2 7B, Llama 3 70B).
SIZES = {
    "125M": GPTSize("125M", 12, 768, 12, 3072, 50257, 2048, source="GPT-3 Small"),
    "1.3B": GPTSize("1.3B", 24, 2048, 16, 8192, 50257, 2048, source="GPT-3 XL"),
    "7B": GPTSize("7B", 32, 4096, 32, 11008, 32000, 4096, llama=True, source="Llama 2 7B"),
    "70B": GPTSize("70B", 80, 8192, 64, 28672, 128256, 8192, llama=True, n_kv_head=8, source="Llama 3 70B"),
}
#: the shape of torchtitan's published 8B runs (Llama 3.1 8B), for the check against their memory figures
LLAMA3_8B = GPTSize("8B", 32, 4096, 32, 14336, 128256, 8192, llama=True, n_kv_head=8, source="Llama 3.1 8B")
STYLES = ("ddp", "fsdp", "fsdp_tp")


@dataclass(frozen=True)
class Estimate:
    """Per-GPU bytes of one (size, style, GPUs) cell; `na` says why the layout is impossible."""

    size: GPTSize
    style: str
    gpus: int
    tp: int
    #: fp32 parameters, gradients and AdamW moments held by this GPU
    states: float
    #: working copies: DDP's bf16 autocast weights (saved for backward) and fp32 gradient buckets (a second
    #: gradient copy unless gradient_as_bucket_view); FSDP's all-gathered current and prefetched unit
    #: (bf16) and one unit's unsharded fp32 gradient before its reduce-scatter
    working: float
    activations: float
    activations_ac: float
    #: data-parallel collectives (all-reduce, or all-gathers and reduce-scatter) this GPU sends per step
    dp_comm: float
    #: tensor-parallel activation collectives this GPU sends per step (full AC repeats the forward's)
    tp_comm: float
    tp_comm_ac: float
    na: str = ""

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that read different sequences."""
        return self.gpus // self.tp

    def total(self, ac: bool) -> float:
        """Peak bytes per GPU, with full activation checkpointing or without."""
        return self.states + self.working + (self.activations_ac if ac else self.activations)

    def fits(self, limit: float) -> str:
        """'yes' without AC, 'AC' only with full AC, 'NO' even with it, under `limit` bytes."""
        if self.na:
            return "n/a"
        return "yes" if self.total(False) <= limit else "AC" if self.total(True) <= limit else "NO"


def ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring all-gather or reduce-scatter of n ranks."""
    return (n - 1) / n


def estimate(size: GPTSize, style: str, gpus: int, *, micro_batch: float = 1.0, tp: int = 8) -> Estimate:
    """Per-GPU memory and communication of `size` trained under `style` on `gpus` GPUs, `micro_batch`
    sequences of `size.seq` tokens per GPU (FSDP x TP: micro_batch * tp per TP group, sharded by sequence
    parallelism, so every style trains the same global batch of gpus * micro_batch sequences)."""
    if style not in STYLES:
        raise ValueError(f"style {style} is not one of {STYLES}")
    tp = tp if style == "fsdp_tp" else 1
    na = ""
    if gpus % tp:
        na = f"TP={tp} does not divide {gpus} GPUs"
    elif (size.n_kv_head or size.n_head) % tp or size.n_head % tp:
        na = f"{size.n_head} heads do not split {tp} ways"
    p, dp = size.params, gpus // tp
    shard = 1 if style == "ddp" else gpus
    states = STATE_BYTES_PER_PARAM * p / shard
    if style == "ddp":
        working = (2 + 4) * p
    else:
        unit = max(size.block_params, size.embedding_params, size.output_params) / tp
        working = (2 + 2 + 4) * unit
    tokens = micro_batch * size.seq  # per GPU; under TP the group's tp-fold tokens are sharded tp ways
    per_layer = 2 * size.act_elems_per_token_layer * tokens
    # loss on fp32 log-probs saved for backward, plus the fp32 gradient of the log-probs and of the logits
    # at the start of backward: 12 bytes per token per vocabulary entry (vocab-sharded under TP)
    logits = 12 * size.vocab * tokens
    activations = size.n_layer * per_layer + logits
    activations_ac = size.n_layer * 2 * size.d_model * tokens + per_layer + logits
    # DDP: an all-reduce of fp32 gradients (2 ring passes); FSDP: bf16 all-gathers in forward and again in
    # backward (reshard after forward), an fp32 reduce-scatter, over the dp ranks holding the same TP shard
    dp_comm = 2 * ring(gpus) * 4 * p if style == "ddp" else ring(dp) * (2 + 2 + 4) * p / tp
    tp_comm = tp_comm_ac = 0.0
    if tp > 1:
        # per block and direction, sequence parallelism's two all-gathers and two reduce-scatters of the
        # TP group's bf16 activations (tp * tokens x d_model): the bytes of two all-reduces
        act = 2 * tp * tokens * size.d_model
        per_direction = size.n_layer * 2 * 2 * ring(tp) * act
        tp_comm, tp_comm_ac = 2 * per_direction, 3 * per_direction
    return Estimate(
        size, style, gpus, tp, states, working, activations, activations_ac, dp_comm, tp_comm, tp_comm_ac, na
    )


#: torchtitan docs/performance.md (commit eaea6f6, H100 96 GB, torch of 2024-12-23): (label, size, style,
#: GPUs, sequences per GPU, published peak GiB, the run's activation checkpointing, what else it used)
PUBLISHED = [
    ("Table 1: FSDP, 8 GPUs, local batch 2", LLAMA3_8B, "fsdp", 8, 2.0, 82.4, "selective", "eager"),
    ("Table 3: FSDP, 128 GPUs, local batch 2", LLAMA3_8B, "fsdp", 128, 2.0, 67.0, "selective", "eager"),
    ("Table 4: FSDP 32 x TP 8, local batch 16", SIZES["70B"], "fsdp_tp", 256, 2.0, 71.9, "full",
     "compile, Float8"),
]  # fmt: skip


def published_check() -> list[tuple[str, float, float, float, str]]:
    """(run, model GiB without AC, with full AC, published GiB, reading) per torchtitan figure, then the
    8 -> 128 GPU difference of Tables 1 and 3 (same activations: only the sharded states differ)."""
    rows = []
    for label, s, style, n, mb, gib, ac, extra in PUBLISHED:
        e = estimate(s, style, n, micro_batch=mb)
        lo, hi = e.total(True) / GiB, e.total(False) / GiB
        if ac == "full":
            reading = f"{gib / lo:.2f}x the full-AC model ({extra})"
        else:  # selective AC saves some of what full AC recomputes: its peak lies between the two
            reading = (
                f"{'within' if lo <= gib <= hi else 'OUTSIDE'} the model's full-AC..no-AC range ({extra})"
            )
        rows.append((f"{s.name} {label}", hi, lo, gib, reading))
    t1, t3 = (estimate(LLAMA3_8B, "fsdp", n, micro_batch=2.0) for n in (8, 128))
    model = (t1.total(True) - t3.total(True)) / GiB
    rows.append(("8B Table 1 minus Table 3 (8 vs 128 GPUs)", model, model, 82.4 - 67.0,
                 f"published {(82.4 - 67.0) / model:.2f}x the model's difference"))  # fmt: skip
    return rows


def model_tables(gpu_counts: list[int], micro_batch: float, limit_gib: float) -> str:
    """The shapes, the per-cell estimates and the published check, as Markdown tables."""
    out = [
        "| size | shape | layers | d_model | heads (kv) | ffn | vocab | seq | parameters |",
        "|---" * 9 + "|",
    ]
    for s in SIZES.values():
        out.append(
            f"| {s.name} | {s.source} | {s.n_layer} | {s.d_model} | {s.n_head} ({s.n_kv_head or s.n_head}) | "
            f"{s.ffn} | {s.vocab} | {s.seq} | {s.params / 1e9:.3f}B |"
        )
    out += [
        "",
        f"{micro_batch:g} sequence(s) per GPU; memory in GiB per GPU, communication in GB (1e9) sent per GPU "
        f"per step; fits: within {limit_gib:g} GiB without activation checkpointing (yes), only with full AC "
        "(AC), or not even then (NO).",
        "",
        "| size | GPUs | style | mesh (dp x tp) | params+grads+AdamW | working copies | activations (no AC / "
        "full AC) | total (no AC / full AC) | fits | DP comm | DP comm vs DDP | TP comm, in node (no AC / "
        "AC) |",
        "|---" * 12 + "|",
    ]
    limit = limit_gib * GiB
    for s in SIZES.values():
        for n in gpu_counts:
            ddp = estimate(s, "ddp", n, micro_batch=micro_batch).dp_comm  # crosses nodes beyond 8 GPUs
            for style in STYLES:
                e = estimate(s, style, n, micro_batch=micro_batch)
                if e.na:
                    out.append(f"| {s.name} | {n} | {style} | - | n/a: {e.na} |" + " |" * 7)
                    continue
                out.append(
                    f"| {s.name} | {n} | {style} | {e.dp} x {e.tp} | {e.states / GiB:.1f} | "
                    f"{e.working / GiB:.1f} | {e.activations / GiB:.1f} / {e.activations_ac / GiB:.1f} | "
                    f"{e.total(False) / GiB:.1f} / {e.total(True) / GiB:.1f} | {e.fits(limit)} | "
                    f"{e.dp_comm / GB:.1f} | {e.dp_comm / ddp:.2f}x | "
                    f"{e.tp_comm / GB:.0f} / {e.tp_comm_ac / GB:.0f} |"
                )
    out += [
        "",
        "Check against torchtitan's published peak memory (docs/performance.md; H100, seq 8192):",
        "",
        "| run | model no AC | model full AC | published | reading |",
        "|---" * 5 + "|",
    ]
    for run, hi, lo, gib, reading in published_check():
        out.append(f"| {run} | {hi:.1f} | {lo:.1f} | {gib:.1f} | {reading} |")
    return "\n".join(out)


# --- measure: real runs of the LM recipe -------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One launch of the LM recipe: its name, argv, the environment it adds, and its run directory."""

    name: str
    argv: list[str]
    env: dict[str, str]
    run_dir: Path


def measure_runs(root: Path, *, steps: int, batch: int, python: str = sys.executable) -> list[Run]:
    """The three launches, same global batch (trainer.batch_size, which ranks split) and steps each, every
    one in its own run directory under `root`: 1 process x 2 threads, then DDP and FSDP on 2 ranks x 1
    thread through torchrun's standalone rendezvous (gloo on a CPU)."""
    log_every = max(1, steps // 4)  # four metrics rows: the first marks the start, past start-up
    common = [
        "+task=lm",
        "device=cpu",
        "compile.policy=off",
        "precision=bf16",  # one for all three: the auto probe may choose per thread count
        f"trainer.max_steps={steps}",
        f"trainer.batch_size={batch}",
        "trainer.eval_every=0",
        f"trainer.log_every={log_every}",
        "trainer.progress=false",
        "logger=none",
    ]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = []
    for name, launcher, parallel, threads in [
        ("1 process x 2 threads", [python], "none", 2),
        ("DDP 2 ranks x 1 thread", torchrun, "ddp", 1),
        ("FSDP 2 ranks x 1 thread", torchrun, "fsdp", 1),
    ]:
        run_dir = root / parallel
        argv = [
            *launcher,
            "-m",
            "recipes.train",
            *common,
            f"trainer.parallel={parallel}",
            f"hydra.run.dir={run_dir}",
        ]
        runs.append(Run(name, argv, {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}, run_dir))
    return runs


def tokens_per_s(rows: list[dict], tokens_per_step: int) -> float:
    """Training tokens/s between the first and last logged rows of rank 0's metrics.jsonl: start-up and
    the first window are left out, and the figure does not depend on how a rank counts samples."""
    logged = [r for r in rows if "train/samples_per_s" in r]
    if len(logged) < 2:
        from core.errors import ConfigError  # lazily: the driver itself imports no torch

        raise ConfigError(  # a ValueError too, as before
            f"{len(logged)} training rows in metrics.jsonl; need 2 (raise --steps)",
            key="--steps",
            value=f"{len(logged)} logged rows",
            valid=(">= 2 logged rows",),
        )
    first, last = logged[0], logged[-1]
    return (last["step"] - first["step"]) * tokens_per_step / (last["time"] - first["time"])


def launch(run: Run, tokens_per_step: int) -> float:
    """Run one launch to the end and return its tokens/s; a failed launch is one line, exit 1."""
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(run.argv, env={**os.environ, **run.env}, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"bench.scaling: {run.name} failed (exit {proc.returncode}): {tail}")
    metrics = run.run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return tokens_per_s(rows, tokens_per_step)


def measure(steps: int, batch: int) -> None:
    """Launch the three runs one after another and print tokens/s and the ratios against the goal."""
    from omegaconf import OmegaConf

    context = OmegaConf.load(REPO / "conf" / "task" / "lm.yaml").task.context
    root = Path(tempfile.mkdtemp(prefix="tk-scaling-"))
    runs = measure_runs(root, steps=steps, batch=batch)
    print(f"LM recipe, {steps} steps of {batch} x {context} tokens, runs under {root}")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    rates = {}
    for run in runs:
        t0 = time.time()
        rates[run.name] = launch(run, batch * context)
        print(f"  {run.name}: {rates[run.name]:.0f} tokens/s ({time.time() - t0:.0f} s wall)", flush=True)
    base = rates[runs[0].name]
    print("| run | tokens/s | vs 1 process x 2 threads | goal |")
    print("|---|---|---|---|")
    for run in runs:
        ratio = rates[run.name] / base
        goal = "-" if run is runs[0] else f">= {GOAL}x: {'met' if ratio >= GOAL else 'not met'}"
        print(f"| {run.name} | {rates[run.name]:.0f} | {ratio:.2f}x | {goal} |")
    print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def main() -> None:
    """Parse flags; print the model's tables or run the measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", action="store_true", help="the analytical tables (no torch work)")
    mode.add_argument("--measure", action="store_true", help="real 1-process vs 2-rank runs of the LM recipe")
    parser.add_argument("--gpus", default="8,64,512", help="GPU counts for --model")
    parser.add_argument("--micro-batch", type=float, default=1.0, help="sequences per GPU for --model")
    parser.add_argument("--limit-gib", type=float, default=80.0, help="GPU memory for the fits column")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run for --measure")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences) for --measure")
    args = parser.parse_args()
    if args.model:
        print(model_tables([int(n) for n in args.gpus.split(",")], args.micro_batch, args.limit_gib))
    else:
        measure(args.steps, args.batch)


if __name__ == "__main__":
    main()
