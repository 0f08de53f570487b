"""`+task=lm model=llama_125m` (the recipe's Trainer) against a plain PyTorch loop around transformers'
LlamaForCausalLM of the same config (`text.checkpoints.hf.config_for` of our model: the 125M preset's sizes
with the bytes tokenizer's 258 ids, context 1024), each in fp32 and, where this CPU multiplies bf16 faster
than fp32, bf16 autocast; each eager and compiled (ours: compile.policy=regional, the recipe's per-block
compile; theirs: `torch.compile` of the whole model). The same batch shape, AdamW and gradient clipping.

Prints tokens/s and MFU (model FLOPs per token: 6 x the matmul parameters + the attention's 12 x layers x
width x context, over the GEMM rate of that precision probed right before each step) side by side, and the
ratios the issue asks for: ours over transformers' eager loop (goal >= 1.3) and over its compiled loop
(goal >= 1.0), in each precision. Transformers' loops run in processes of their own, on glibc's heap defaults
as their users run them (the recipe's CPU plan keeps freed memory, core.device.allocator). Run on a quiet
machine:

    OMP_NUM_THREADS=2 python -m bench.llama_speed [--batch 2] [--steps 4] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.data import python_in_fresh_process
from bench.text_speed import PeakProbe, TimedLM
from core.compile import CompileConfig
from core.loop.trainer import Trainer, TrainerConfig
from core.optim import OptimConfig

PRESET, CONTEXT, VOCAB = "llama_125m", 1024, 258
LR, WD, BETAS = 1e-3, 0.1, (0.9, 0.95)


def bf16_speedup() -> float:
    """bf16 over fp32 GEMM rate here (1536^2 torch.mm, best of 5): above 1, the CPU has bf16 matmul."""

    def rate(dtype: torch.dtype) -> float:
        a, b = torch.randn(1536, 1536, dtype=dtype), torch.randn(1536, 1536, dtype=dtype)
        torch.mm(a, b)
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        return 1 / best

    return rate(torch.bfloat16) / rate(torch.float32)


def ours(
    batch: int, steps: int, precision: str, compiled: bool, probe: PeakProbe, policy: str = "regional"
) -> int:
    """The recipe's Trainer for `steps` steps, `probe` before each (compiled: compile.policy=`policy`);
    returns the model's parameter count."""
    task = TimedLM(model={"name": PRESET}, data={"name": "kjv"}, context=CONTEXT, val_chunks=1, probe=probe)
    cfg = TrainerConfig(
        max_epochs=1, max_steps=steps, batch_size=batch, log_every=steps, progress=False, grad_clip=1.0
    )
    optim = OptimConfig(lr=LR, weight_decay=WD, betas=list(BETAS))
    compile_cfg = CompileConfig(policy=policy if compiled else "off")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            task, cfg, optim, run_dir=Path(tmp), device="cpu", precision=precision, compile_cfg=compile_cfg
        )
        trainer.fit()
        probe()  # closes the last step
        return sum(p.numel() for p in trainer.model.parameters())


def reference_model() -> Any:
    """transformers' LlamaForCausalLM of our preset's config (its weights random)."""
    import transformers

    from core.registry import MODELS
    from text.checkpoints.hf import config_for

    config = config_for(MODELS.build(PRESET, vocab_size=VOCAB, context=CONTEXT))
    config.pop("architectures", None)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))


def theirs(
    batch: int, steps: int, precision: str, compiled: bool, probe: PeakProbe, data: torch.Tensor
) -> None:
    """A plain loop around transformers' model: random windows of `data`, cross-entropy, AdamW."""
    torch.manual_seed(0)
    model = reference_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    for _ in range(steps):
        probe()
        ix = torch.randint(len(data) - CONTEXT - 1, (batch,)).tolist()
        x = torch.stack([data[i : i + CONTEXT] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + CONTEXT] for i in ix])
        with autocast:
            logits = forward(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    probe()


def corpus() -> torch.Tensor:
    """The text both loops sample windows from: the first 20 KJV books as byte ids."""
    from text.corpus import kjv_books
    from text.tokenizer import ByteTokenizer

    return torch.tensor(ByteTokenizer().encode("".join(kjv_books()[:20])), dtype=torch.long)


def theirs_in_a_fresh_process(batch: int, steps: int, precision: str, compiled: bool) -> list[list[float]]:
    """`theirs` in a process of its own, on glibc's heap defaults as its users run it (our runs set this
    process's heap policy, core.device.allocator); its probe's (step seconds, GEMM FLOP/s) pairs."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    code = (
        "import json, torch; from bench.llama_speed import PeakProbe, corpus, theirs; "
        f"probe = PeakProbe(dtype=torch.{dtype}); "
        f"theirs({batch}, {steps}, {precision!r}, {compiled}, probe, corpus()); "
        "print(json.dumps(probe.steps()))"
    )
    return json.loads(python_in_fresh_process(code))


def main() -> None:
    """Run every (loop, precision, mode) and print the table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles in the first)")
    ap.add_argument("--policy", default="regional", choices=["regional", "full"], help="our compile.policy")
    ap.add_argument("--precisions", default="fp32,bf16", help="of fp32,bf16 (bf16 only where it pays here)")
    args = ap.parse_args()
    speedup = bf16_speedup()
    asked = args.precisions.split(",")
    precisions = [p for p in ("fp32", "bf16") if p in asked and (p == "fp32" or speedup > 1.0)]
    print(
        f"bf16/fp32 GEMM rate here: {speedup:.2f}x -> precisions {precisions}; ours compiled: "
        f"compile.policy={args.policy}; torch {torch.__version__}"
    )
    n_params = 0
    results: dict[tuple[str, str, str], tuple[float, float]] = {}
    tokens = args.batch * CONTEXT
    total = args.warmup + args.steps
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for mode in ("eager", "compiled"):
            for loop in ("transformers", "torchkiln"):
                if loop == "torchkiln":
                    probe = PeakProbe(dtype=dtype)
                    n_params = ours(args.batch, total, precision, mode == "compiled", probe, args.policy)
                    pairs = probe.steps()[args.warmup :]
                else:
                    pairs = theirs_in_a_fresh_process(args.batch, total, precision, mode == "compiled")
                    pairs = pairs[args.warmup :]
                results[(precision, mode, loop)] = (
                    statistics.median(t for t, _ in pairs),
                    statistics.median(r for _, r in pairs),
                )
    d, layers = 768, 12
    # the tied head multiplies by the embedding's matrix: every parameter but the norms' gains is a matmul's
    flops_per_token = 6 * n_params + 12 * layers * d * CONTEXT
    print(f"model {PRESET}: {n_params / 1e6:.1f}M parameters, {flops_per_token / 1e6:.0f} MFLOP per token")
    print(f"{'precision':>9} {'mode':>8} {'loop':>12} {'tokens/s':>9} {'MFU':>6}")
    for (precision, mode, loop), (sec, rate) in results.items():
        mfu = tokens * flops_per_token / sec / rate
        print(f"{precision:>9} {mode:>8} {loop:>12} {tokens / sec:9.0f} {mfu:6.1%}")
    # raw: tokens/s; drift-normalized: tokens/s over the GEMM rate probed around the same steps, which is what
    # one loop would give the other's moment (the host's rate moves by +-25% from minute to minute)
    for kind, weight in (("raw", lambda r: 1.0), ("drift-normalized", lambda r: 1 / r)):
        for precision in precisions:
            speed = {
                k: tokens / sec * weight(rate) for k, (sec, rate) in results.items() if k[0] == precision
            }
            mine = {m: speed[(precision, m, "torchkiln")] for m in ("eager", "compiled")}
            ref = {m: speed[(precision, m, "transformers")] for m in ("eager", "compiled")}
            best = max(mine.values())
            print(
                f"{precision} {kind}: torchkiln best ({max(mine, key=mine.get)}) / transformers eager "
                f"{best / ref['eager']:.3f}x (goal >= 1.3), / transformers compiled "
                f"{best / ref['compiled']:.3f}x (goal >= 1.0); "
                f"eager/eager {mine['eager'] / ref['eager']:.3f}x, "
                f"compiled/compiled {mine['compiled'] / ref['compiled']:.3f}x"
            )


if __name__ == "__main__":
    main()
