"""The MFU a run logs, beside an independent torch.mm peak taken in the same minutes, and nanoGPT's loop timed
beside the run (issue #41 points 1 and 2).

The LM recipe trains at nanoGPT's shape (bench/text_speed.py's SHAPE) in each precision; the bench reads
`train/mfu` and the peak the run measured for itself, and times torch.mm on its own, before and after the run,
at the sizes and repetitions a careful reader would use (up to 4096, the best of 10). The logged MFU must
never exceed 1, and should agree with the MFU against the independent peak. nanoGPT's training loop (the
plain GPT of bench/text_speed.py: eager, fp32 as nanoGPT runs on a CPU) is timed before the first and after
the last recipe run; each recipe run's tokens/s is divided by the mean of the two. After each run, the
step's matmuls are timed alone in its dtype (bench.text_speed.matmul_ceiling): the MFU of a step that did
nothing else, the most that cutting the rest of the step could reach.

    python -m bench.mfu [--steps 30] [--precisions fp32,bf16] [--compile off|regional|full]
        [--compile-mode default|max-autotune|...] [--attention auto|sdpa|unblocked]
        [--profile [--by-shape]] [--drift] [--trace SECONDS] [--gemms SECONDS]

--drift times no nanoGPT loop: a short GEMM probe in the run's dtype runs before every training step, and
each step's MFU is also divided by the host's rate of that minute (the probe's over its best), to tell the
host's drift from the step's own time.
--trace times no training: the host's matmul rate in each precision every 0.2 s for SECONDS (the best of 10
2048^2 `torch.mm`), and its quartiles: whether the peak is stationary here, so that a peak measured once means
the same minute to minute.
--gemms times no training: each distinct GEMM of the step's linear layers (forward, input gradient, weight
gradient) and a 2048^2 square, back to back for SECONDS each, alone: median and 90th percentile GFLOP/s, so a
GEMM's own rate at its shape can be told from what the step around it costs.
--attention sdpa keeps core.attention on SDPA's kernel (the short bf16 path never chosen), for a before/after;
--attention unblocked keeps the short path's causal queries in one block (core/attention/cpu_bf16_causal.py).
--profile times nothing: it runs torch.profiler over the recipe's training steps (after 3 untimed) in each
precision and prints each kind of op's milliseconds per step: where the step goes. --by-shape adds the GEMMs'
(mm, bmm) milliseconds per step by input shape: run it with --compile off and full to see which GEMMs a
compiled step runs slower.

bf16 needs a CPU with bf16 matmul: where the device probe measured bf16 slower than fp32, the bf16 row says
so and is skipped (a bf16 run there measures emulation, not the loop).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.data import python_in_fresh_process
from bench.text_speed import (
    SHAPE,
    VOCAB,
    PeakProbe,
    kjv_bytes,
    linear_shapes,
    matmul_ceiling,
    plain_loop,
    recipe_loop,
)
from core.device import resolve


def independent_peak(
    dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 4096), reps: int = 10
) -> float:
    """Best FLOP/s of torch.mm in `dtype` over `sizes` (each warmed up, then the best of `reps`), at the
    process's threads; sizes whose one matmul takes over 2 s are not tried."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if time.perf_counter() - t0 > 2.0:
            break
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def one(
    precision: str, steps: int, compile_policy: str = "off", compile_mode: str = "default"
) -> dict[str, float]:
    """Train `steps` steps in `precision` (compile policy `compile_policy`, mode `compile_mode`); the logged
    MFU and peak, the independent peak around it, and the rate of the step's matmuls alone."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = independent_peak(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        recipe_loop(steps, run, compile_policy, precision=precision, log_every=5, compile_mode=compile_mode)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = independent_peak(dtype)
    ceiling = matmul_ceiling(dtype=dtype)
    rows = [r for r in rows if "train/mfu" in r][1:]  # the first window holds the warm-up steps
    logged = max(r["train/mfu"] for r in rows)
    tflops = max(r["train/tflops"] for r in rows)
    peak = max(before, after)
    return {
        "logged_mfu_max": logged,
        "logged_mfu_median": statistics.median(r["train/mfu"] for r in rows),
        "logged_tflops_max": tflops,
        "tokens_per_s_median": statistics.median(r["train/tokens_per_s"] for r in rows),
        "independent_peak_gflops": peak / 1e9,
        "mfu_vs_independent_peak": tflops * 1e12 / peak,
        "matmul_ceiling_gflops": ceiling / 1e9,
    }


def drift(precision: str, steps: int, compile_policy: str = "off") -> dict[str, float]:
    """Train `steps` steps with a short GEMM probe in the run's dtype before each (bench.text_speed's
    PeakProbe, outside the step's time): each step's MFU against the independent peak as it is, and against
    that peak scaled by the probe's rate right then over its best in the run (the peak the host offered in
    that minute). Medians over the steps after 3; with the probe rates' spread."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak = independent_peak(dtype)
    probe = PeakProbe(dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        recipe_loop(steps + 3, Path(tmp) / "run", compile_policy, probe, precision, 100)
    pairs = probe.steps()[3:]
    peak = max(peak, independent_peak(dtype))
    flops = step_flops()
    best_rate = max(rate for _, rate in pairs)
    return {
        "independent_peak_gflops": peak / 1e9,
        "step_ms_median": 1e3 * statistics.median(t for t, _ in pairs),
        "mfu_median": statistics.median(flops / (t * peak) for t, _ in pairs),
        "mfu_drift_normalised_median": statistics.median(
            flops / (t * peak * rate / best_rate) for t, rate in pairs
        ),
        "probe_rate_min_over_best": min(rate for _, rate in pairs) / best_rate,
    }


def trace(precision: str, seconds: float, n: int = 2048) -> list[float]:
    """The best FLOP/s of 10 `n`^2 matmuls (5 PeakProbe calls) in `precision`'s dtype, every 0.2 s for
    `seconds`."""
    probe = PeakProbe(n, torch.bfloat16 if precision == "bf16" else torch.float32)
    end, rates = time.perf_counter() + seconds, []
    while time.perf_counter() < end:
        for _ in range(5):
            probe()
        rates.append(max(rate for _, _, rate in probe.marks[-5:]))
        time.sleep(0.2)
    return rates


def gemm_rates(precision: str, seconds: float) -> dict[str, tuple[float, float]]:
    """Median and 90th-percentile FLOP/s of each distinct GEMM of the step's linear layers (the forward as
    F.linear runs it, the input gradient, the weight gradient as autograd computes it) and of a 2048^2 square,
    in `precision`'s dtype, each called back to back for `seconds` (at least twice) after one untimed call."""
    import torch.nn.functional as F

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = SHAPE["batch"] * SHAPE["context"]
    cases: dict[str, tuple[Callable[[], object], int]] = {}
    for i, o in dict.fromkeys(linear_shapes()):
        x, w, g = (torch.randn(*s, dtype=dtype) for s in ((tokens, i), (o, i), (tokens, o)))
        flop = 2 * tokens * i * o
        cases[f"forward [{tokens}, {i}] x [{i}, {o}]"] = (lambda x=x, w=w: F.linear(x, w), flop)
        cases[f"input gradient [{tokens}, {o}] x [{o}, {i}]"] = (lambda g=g, w=w: torch.mm(g, w), flop)
        cases[f"weight gradient [{o}, {tokens}] x [{tokens}, {i}]"] = (
            lambda g=g, x=x: torch.mm(g.t(), x),
            flop,
        )
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    cases["square [2048, 2048] x [2048, 2048]"] = (lambda: torch.mm(a, b), 2 * 2048**3)
    out = {}
    for name, (call, flop) in cases.items():
        call()
        rates: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(rates) < 2:
            t0 = time.perf_counter()
            call()
            rates.append(flop / (time.perf_counter() - t0))
        out[name] = (statistics.median(rates), statistics.quantiles(rates, n=10)[-1])
    return out


def step_flops() -> float:
    """Model FLOPs of one training step at SHAPE, as the run's flop counter counts them: 6 per matmul
    weight (the blocks' and the tied head's) and token, plus attention's 12 * layers * width * context."""
    s = SHAPE
    d, layers = s["d_model"], s["n_layer"]
    params = VOCAB * d + layers * 12 * d * d
    return s["batch"] * s["context"] * (6 * params + 12 * layers * d * s["context"])


#: the profiler's event around a compiled graph (torch 2.x Inductor): its self time is the fused kernels'
COMPILED_GRAPH = "## Call CompiledFxGraph"
#: op kinds of the profile, by a piece of the aten op's name; the rest is counted as "other"
OP_KINDS = {
    "linear GEMMs (mm)": ("aten::mm", "aten::addmm"),
    "attention GEMMs (bmm)": ("aten::bmm", "aten::baddbmm"),
    "SDPA's flash kernel": ("_scaled_dot_product_flash_attention",),
    "softmax": ("aten::_softmax",),
    "GELU": ("aten::gelu",),
    "copies and casts": ("aten::copy_",),
    "LayerNorm": ("layer_norm",),
    "AdamW (fused)": ("_fused_adamw",),
}


class _ProfilerSteps:
    """Stands in for bench.text_speed's PeakProbe in recipe_loop: steps the profiler before each training
    step instead of probing the GEMM rate."""

    def __init__(self, prof: torch.profiler.profile) -> None:
        self.prof = prof

    def __call__(self) -> None:
        self.prof.step()

    def steps(self) -> list[tuple[float, float]]:
        return []


def profile(
    precision: str, steps: int, compile_policy: str = "off", by_shape: bool = False
) -> tuple[dict[str, float], dict[str, float]]:
    """Self milliseconds per training step of each OP_KINDS kind (and "other", compiled graphs' own kernels
    where it compiles, "all ops", the median step's wall and the part of it outside ops) over `steps` steps
    after 3 untimed, by torch.profiler; with `by_shape`, also the GEMMs' (mm, bmm) by op and input shapes."""
    from torch.profiler import ProfilerActivity, schedule

    plan = schedule(wait=2, warmup=1, active=steps, repeat=1)
    profiler = torch.profiler.profile(
        activities=[ProfilerActivity.CPU], schedule=plan, record_shapes=by_shape
    )
    with tempfile.TemporaryDirectory() as tmp, profiler as prof:
        recipe_loop(steps + 4, Path(tmp) / "run", compile_policy, _ProfilerSteps(prof), precision, 100)
    out = dict.fromkeys([*OP_KINDS, "other"], 0.0)
    for event in prof.key_averages():
        if event.key.startswith(COMPILED_GRAPH):  # its self time: Inductor's own kernels, not the aten calls
            out["compiled graphs' kernels"] = out.get("compiled graphs' kernels", 0.0)
            out["compiled graphs' kernels"] += event.self_cpu_time_total / 1e3 / steps
            continue
        if not event.key.startswith("aten::"):
            continue  # autograd nodes and profiler steps hold the aten ops' time
        kind = next((k for k, names in OP_KINDS.items() if any(n in event.key for n in names)), "other")
        out[kind] += event.self_cpu_time_total / 1e3 / steps
    out["all ops"] = sum(out.values())
    # each ProfilerStep event spans one whole step: wall time, of which "all ops" is the part inside ops
    walls = [e.cpu_time_total / 1e3 for e in prof.events() if e.name.startswith("ProfilerStep")]
    out["step wall"] = statistics.median(walls) if walls else math.nan
    out["outside ops"] = out["step wall"] - out["all ops"]
    gemms: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True) if by_shape else []:
        if event.key in ("aten::mm", "aten::bmm"):
            # inputs only: compiled code passes out= buffers, which eager calls lack
            shapes = "x".join(str(s) for s in event.input_shapes[:2])
            name = f"{event.key[6:]} {shapes}"
            gemms[name] = gemms.get(name, 0.0) + event.self_cpu_time_total / 1e3 / steps
    return out, gemms


def nanogpt_tokens_per_s(steps: int) -> float:
    """Tokens/s of nanoGPT's loop (the plain GPT, eager fp32) at SHAPE, by its median step after 3 untimed,
    in a fresh process: the recipe's runs set this one's heap policy (core.device.allocator), and nanoGPT
    runs on glibc's defaults."""
    code = f"from bench.mfu import plain_tokens_per_s; print(plain_tokens_per_s({steps}))"
    return float(python_in_fresh_process(code))


def plain_tokens_per_s(steps: int) -> float:
    """Tokens/s of nanoGPT's loop in this process (see nanogpt_tokens_per_s)."""
    times = plain_loop(kjv_bytes(), steps + 3)[3:]
    return SHAPE["batch"] * SHAPE["context"] / statistics.median(times)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--compile", default="off", help="the recipe's compile.policy: off, regional, full")
    parser.add_argument("--attention", choices=("auto", "sdpa", "unblocked"), default="auto")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode, where it compiles")
    parser.add_argument("--profile", action="store_true", help="where each step goes, instead of timing")
    parser.add_argument("--by-shape", action="store_true", help="with --profile: GEMM ms by input shape")
    parser.add_argument(
        "--drift", action="store_true", help="each step's MFU also against the host's rate of that minute"
    )
    parser.add_argument(
        "--trace", type=float, default=0.0, help="seconds of the host's matmul rate over time"
    )
    parser.add_argument(
        "--gemms", type=float, default=0.0, help="seconds each of the step's GEMMs back to back, alone"
    )
    return parser


def main() -> None:
    """Print one row per precision."""
    args = _parser().parse_args()
    from core.attention import cpu_bf16

    if args.attention == "sdpa":
        cpu_bf16.MARGIN = math.inf  # no timing can show the short path that much faster
    if args.attention == "unblocked":
        cpu_bf16.QUERY_BLOCK = 2**31  # causal queries in one block: the whole score matrix
    plan = resolve("cpu", "auto")
    bf16_speed = plan.probe.speedup("bf16") if plan.probe is not None else None
    print(f"host: {plan.facts.cpu.describe()}; {torch.get_num_threads()} threads; shape {SHAPE}")
    precisions = args.precisions.split(",")
    if args.trace:
        _print_trace(precisions, args.trace)
    elif args.gemms:
        for precision in precisions:
            for name, (median, q90) in gemm_rates(precision, args.gemms).items():
                print(f"{precision}: {name}: median {median / 1e9:.0f}, q90 {q90 / 1e9:.0f} GFLOP/s")
    elif args.profile:
        _print_profile(precisions, args)
    elif args.drift:
        _print_drift(precisions, args)
    else:
        _print_against_nanogpt(precisions, args, bf16_speed)


def _print_trace(precisions: list[str], seconds: float) -> None:
    """--trace: the host's 2048^2 matmul rate every 0.2 s, and its spread."""
    for precision in precisions:
        rates = [r / 1e9 for r in trace(precision, seconds)]
        q = statistics.quantiles(rates, n=4)
        print(f"{precision}: 2048^2 matmul GFLOP/s every 0.2 s: " + " ".join(f"{r:.0f}" for r in rates))
        quartiles = " / ".join(f"{x:.0f}" for x in q)
        print(f"{precision}: min {min(rates):.0f}, quartiles {quartiles}, max {max(rates):.0f}")


def _print_profile(precisions: list[str], args: argparse.Namespace) -> None:
    """--profile: ms per training step by kind of work (and by GEMM shape), by torch.profiler."""
    for precision in precisions:
        kinds, gemms = profile(precision, args.steps, args.compile, args.by_shape)
        print(f"{precision}, attention {args.attention}: ms per training step, by torch.profiler")
        for kind, ms in kinds.items():
            print(f"  {kind:<24} {ms:8.1f}")
        for shapes, ms in sorted(gemms.items(), key=lambda kv: -kv[1]):
            print(f"  {shapes:<40} {ms:8.1f}")


def _print_drift(precisions: list[str], args: argparse.Namespace) -> None:
    """--drift: the MFU as timed and against the host's rate of each step's minute."""
    for precision in precisions:
        out = drift(precision, args.steps, args.compile)
        print(
            f"{precision}: step {out['step_ms_median']:.0f} ms (median) | MFU against the independent "
            f"peak {out['independent_peak_gflops']:.1f} GFLOP/s: {out['mfu_median']:.3f} as timed, "
            f"{out['mfu_drift_normalised_median']:.3f} drift-normalised | the probe's slowest step "
            f"{out['probe_rate_min_over_best']:.2f}x its fastest",
            flush=True,
        )


def _print_against_nanogpt(precisions: list[str], args: argparse.Namespace, bf16_speed: float | None) -> None:
    """The recipe's MFU per precision, and its tokens/s against nanoGPT's loop timed before and after."""
    nanogpt = [nanogpt_tokens_per_s(args.steps)]
    results = {}
    for precision in precisions:
        if precision == "bf16" and (bf16_speed is None or bf16_speed < 1.0):
            print(f"bf16: skipped, the device probe measured bf16 at {bf16_speed}x fp32 (no fast bf16 here)")
            continue
        results[precision] = out = one(precision, args.steps, args.compile, args.compile_mode)
        print(
            f"{precision}: logged MFU (max over windows) {out['logged_mfu_max']:.3f}, median "
            f"{out['logged_mfu_median']:.3f} | {out['logged_tflops_max'] * 1e3:.1f} GFLOP/s against an "
            f"independent torch.mm peak of {out['independent_peak_gflops']:.1f} GFLOP/s = MFU "
            f"{out['mfu_vs_independent_peak']:.3f} | ratio logged / independent "
            f"{out['logged_mfu_max'] / out['mfu_vs_independent_peak']:.2f}\n"
            f"{precision}: the step's matmuls alone (bench.text_speed.matmul_ceiling) "
            f"{out['matmul_ceiling_gflops']:.1f} GFLOP/s = "
            f"{out['matmul_ceiling_gflops'] / out['independent_peak_gflops']:.3f} of that peak: "
            "the MFU of a step that did nothing else",
            flush=True,
        )
    nanogpt.append(nanogpt_tokens_per_s(args.steps))
    base = statistics.mean(nanogpt)
    print(f"nanoGPT's loop, eager fp32: {nanogpt[0]:.0f} tokens/s before, {nanogpt[1]:.0f} after")
    for precision, out in results.items():
        print(
            f"{precision}: recipe {out['tokens_per_s_median']:.0f} tokens/s (median window) = "
            f"{out['tokens_per_s_median'] / base:.2f}x nanoGPT's eager fp32 loop"
        )


if __name__ == "__main__":
    main()
