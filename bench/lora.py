"""LoRA against full fine-tuning: trainable parameters, optimizer state bytes and peak resident memory of a
few AdamW steps of the `llama_125m` preset, each mode in a process of its own.

`python -m bench.lora` (default: vocabulary 50,257, context 32, batch 2, 2 steps, rank 8 on q_proj and
v_proj, fp32 on the CPU: under a minute on one thread); `--context 512` weighs the activations more. Each
mode (`--child full|lora`) builds the model through `core.distributed.parallelize` (which applies
`trainer.lora`), the optimizer with `core.optim.build_optimizer` (the trainable parameters alone), and runs
the steps. Peak memory is the
process's VmHWM after the steps: weights, gradients, moments and activations together, plus the
interpreter's and torch's own (about the same in both modes). Optimizer state bytes are the tensors AdamW
holds after the steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("/proc/self/status has no VmHWM: the measurement needs Linux")


def child(args: argparse.Namespace) -> dict[str, float]:
    """One mode's steps; returns its trainable parameters, optimizer state bytes and peak RSS in MiB."""
    import torch
    import torch.nn.functional as F

    import text  # noqa: F401  (registers the llama presets)
    from core.distributed import MeshShape
    from core.distributed.parallelize import parallelize
    from core.nn.lora import LoRAConfig
    from core.optim import OptimConfig, build_optimizer
    from core.registry import MODELS

    torch.manual_seed(0)
    model = MODELS.build("llama_125m", vocab_size=args.vocab, context=args.context)
    lora = LoRAConfig(rank=args.rank if args.child == "lora" else 0, targets=args.targets.split(","))
    model = parallelize(model.train(), MeshShape(), lora=lora)
    opt = build_optimizer(model, OptimConfig(lr=1e-4))
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated, as in a run
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_state_bytes": state,
        "peak_rss_mib": _vm_hwm_mib(),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run both modes, print each one's figures and LoRA's ratios to full fine-tuning."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--child", choices=("full", "lora"))
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    forwarded = list(argv if argv is not None else sys.argv[1:])
    out = {}
    for mode in ("full", "lora"):
        done = subprocess.run(
            [sys.executable, "-m", "bench.lora", *forwarded, "--child", mode],
            check=True,
            stdout=subprocess.PIPE,  # the child's errors reach the terminal
            text=True,
        )
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        r = out[mode]
        print(
            f"{mode:>4}: params {r['params']:,}, trainable {r['trainable']:,}, optimizer state "
            f"{r['optimizer_state_bytes'] / 2**20:,.1f} MiB, peak RSS {r['peak_rss_mib']:,.0f} MiB"
        )
    full, lora = out["full"], out["lora"]
    print(
        f"lora/full: trainable {lora['trainable'] / full['trainable']:.4f}, optimizer state "
        f"{lora['optimizer_state_bytes'] / full['optimizer_state_bytes']:.4f}, peak RSS "
        f"{lora['peak_rss_mib'] / full['peak_rss_mib']:.3f}"
    )
    return out


if __name__ == "__main__":
    main()
