"""Text targets of torchkiln, measured side by side in one run on this machine.

    python -m bench.text                     # all parts
    python -m bench.text --parts speed       # speed: recipe vs plain GPT loop, MFU vs a measured GEMM peak
    python -m bench.text --parts lm,cls      # quality: default LM recipe's val loss; classifier vs BoW LR
    python -m bench.text --parts speed --isa avx2   # the same on an AVX2 machine (the issue's): see --isa
    python -m bench.text --parts layer       # per-layer costs of the step's non-matmul parts, alternatives

speed: the LM recipe's training loop (core.loop.trainer.Trainer driving the `lm` task, bytes tokenizer)
against
a plain PyTorch GPT training loop written below, at nanoGPT's character shape (6 layers, 6 heads, 384 wide,
context 256, batch 12, fp32, no dropout). Each side's tokens/s is batch*context over its median step time
(the whole loop iteration: batch, forward, backward, clip, AdamW, logging); the plain loop runs before and
after the recipe and its two medians are averaged, so drift on a shared machine shows. MFU = model FLOPs
per token (6N + 12*L*d*T, N without position embeddings) * tokens/s / the fp32 GEMM rate, per step against
a short GEMM probe taken right before it (PeakProbe; outside the timed window), median over steps; the same
against the run's best GEMM rate is printed too.
It also times the step's matmuls alone at their real shapes: no loop can beat that rate, so it bounds MFU.
--isa avx2 re-runs the bench with MKL, oneDNN and ATen's kernels limited to AVX2 (MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), i.e. as on an AVX2-only CPU such as the one the 80% MFU goal was
set on: on an AVX-512 CPU the GEMM peak more than doubles while the memory- and exp-bound parts of the step
(attention softmax, GELU, norms, optimizer) barely change, so the same loop reaches a lower MFU there.
layer: forward + backward ms per layer at the speed shape for the parts of the step that are not GEMMs
(SDPA causal and non-causal, core.attention's math path, GELU erf and tanh), to show where the time goes.
lm: `python -m recipes.train +task=lm` with its defaults; wall time and final validation loss (nats/byte).
cls: `python -m recipes.train +task=text_classification` with its defaults against a bag-of-words
(CountVectorizer) logistic regression fitted on the same verse split.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench.text_layers import layer_parts
from bench.text_quality import cls_quality, lm_quality
from bench.text_speed import speed

ISA_ENV = {
    "native": {},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def main() -> None:
    """Run the selected parts and print one JSON line of every number at the end."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="speed,lm,cls", help="comma-separated: speed, layer, lm, cls")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per side (speed)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per side (speed)")
    p.add_argument("--compile", default="off", help="compile.policy of the recipe side (speed): off, full")
    p.add_argument("--isa", choices=sorted(ISA_ENV), default="native", help="limit the CPU kernels' ISA")
    args = p.parse_args()
    env = {**os.environ, **ISA_ENV[args.isa]}
    if env != dict(os.environ):
        # MKL, oneDNN and ATen read these once, when they load: run the parts in a process that has them
        os.execve(sys.executable, [sys.executable, "-m", "bench.text", *sys.argv[1:]], env)
    parts = set(args.parts.split(","))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels "
          f"{torch.backends.cpu.get_cpu_capability()} (--isa {args.isa})", flush=True)  # fmt: skip
    results: dict[str, float] = {}
    if "speed" in parts:
        results |= speed(args.steps, args.warmup, args.compile)
    if "layer" in parts:
        results |= layer_parts()
    with tempfile.TemporaryDirectory() as tmp:
        if "lm" in parts:
            results |= lm_quality(Path(tmp))
        if "cls" in parts:
            results |= cls_quality(Path(tmp))
    print(json.dumps({k: round(v, 4) for k, v in results.items()}))


if __name__ == "__main__":
    main()
