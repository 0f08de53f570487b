"""The LM recipe's training loop against a plain PyTorch GPT loop at nanoGPT's character shape: tokens/s and
MFU against a GEMM rate probed right before each step, and the step's matmuls alone as the MFU ceiling.
`python -m bench.text --parts speed` runs it (see bench/text.py for the method)."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.compile import CompileConfig
from core.device.allocator import retain_freed_memory
from core.loop.trainer import Trainer, TrainerConfig
from core.optim import OptimConfig
from text.lm import LanguageModeling

SHAPE = {"n_layer": 6, "n_head": 6, "d_model": 384, "context": 256, "batch": 12}
VOCAB = 258  # the bytes tokenizer: 256 bytes + pad + end of document


# ---- the reference: a plain GPT and its training loop, no torchkiln -------------------------------------
class PlainBlock(nn.Module):
    """GPT-2 block written directly against torch."""

    def __init__(self, d: int, heads: int) -> None:
        """Width `d`, `heads` attention heads, no biases."""
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention then MLP, both residual."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PlainGPT(nn.Module):
    """Embeddings, blocks, final norm, tied head."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, d: int) -> None:
        """The reference model at the given shape."""
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(PlainBlock(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for token ids (B, T)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


class PeakProbe:
    """A short GEMM timing taken right before each training step, so every step's MFU has its own peak.

    The host's speed drifts by up to +-25% from minute to minute; a peak measured once, minutes away from
    the steps it divides, carried that drift into the MFU. Probing before every step (two 1536^2 `torch.mm`,
    ~50 ms, outside the step's timed window) pairs each step with the machine's rate at that moment.
    """

    def __init__(self, n: int = 1536, dtype: torch.dtype = torch.float32) -> None:
        """Square operands of size `n` in `dtype` (fp32 by default)."""
        self.a, self.b, self.n = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype), n
        torch.mm(self.a, self.b)
        self.marks: list[tuple[float, float, float]] = []  # (probe start, probe end = step start, FLOP/s)

    def __call__(self) -> None:
        """Probe now; the step that follows starts when this returns."""
        t0 = time.perf_counter()
        best = math.inf
        for _ in range(2):
            t = time.perf_counter()
            torch.mm(self.a, self.b)
            best = min(best, time.perf_counter() - t)
        self.marks.append((t0, time.perf_counter(), 2 * self.n**3 / best))

    def steps(self) -> list[tuple[float, float]]:
        """(step seconds, GEMM FLOP/s around it) per completed step: from a probe's end to the next probe's
        start, with the mean of those two probes' rates."""
        return [(b[0] - a[1], (a[2] + b[2]) / 2) for a, b in zip(self.marks, self.marks[1:], strict=False)]


def plain_loop(data: torch.Tensor, steps: int, probe: PeakProbe | None = None) -> list[float]:
    """Train the plain GPT on random windows of `data` for `steps` steps; per-step wall seconds."""
    torch.manual_seed(0)
    s = SHAPE
    model = PlainGPT(VOCAB, s["context"], s["n_layer"], s["n_head"], s["d_model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for _ in range(steps):
        if probe is not None:
            probe()
        start = time.perf_counter()
        ix = torch.randint(len(data) - s["context"] - 1, (s["batch"],))
        x = torch.stack([data[i : i + s["context"]] for i in ix.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + s["context"]] for i in ix.tolist()])
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    if probe is not None:
        probe()  # closes the last step
    return times


class TimedLM(LanguageModeling):
    """The lm task, stamping the time of each training step so the loop's iteration time can be read."""

    def __init__(self, *args: object, probe: PeakProbe | None = None, **kwargs: object) -> None:
        """As LanguageModeling; `probe` runs before each training step (outside its timed window)."""
        super().__init__(*args, **kwargs)
        self.stamps: list[float] = []
        self.probe = probe

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):  # noqa: ANN201
        """Probe and stamp, then the task's own step."""
        if model.training:
            if self.probe is not None:
                self.probe()
            self.stamps.append(time.perf_counter())
        return super().step(model, batch)


def recipe_loop(
    steps: int,
    run_dir: Path,
    compile_policy: str = "off",
    probe: PeakProbe | None = None,
    precision: str = "fp32",
    log_every: int = 20,
    compile_mode: str = "default",
) -> tuple[list[float], int]:
    """Run the LM recipe's Trainer for `steps` steps at SHAPE (torch.compile mode `compile_mode` where it
    compiles); (per-step wall seconds, parameter count)."""
    s = SHAPE
    model = {"name": "gpt", "n_layer": s["n_layer"], "n_head": s["n_head"], "d_model": s["d_model"]}
    task = TimedLM(model=model, data={"name": "kjv"}, context=s["context"], val_chunks=2, probe=probe)
    cfg = TrainerConfig(
        max_epochs=1,
        max_steps=steps + 1,
        batch_size=s["batch"],
        log_every=log_every,
        progress=False,
        eval_every=0,
    )
    # fp32 (the default) like the plain loop: precision=auto may choose bf16 autocast on AMX/AVX512-BF16 CPUs
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    # compile "off" by default: policy=auto would stay eager anyway in a run this short (auto_min_run_seconds)
    compile_cfg = CompileConfig(policy=compile_policy, mode=compile_mode)
    trainer = Trainer(
        task, cfg, optim, run_dir=run_dir, device="cpu", precision=precision, compile_cfg=compile_cfg
    )
    trainer.fit()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    if probe is not None:  # stamp to stamp would include the next step's probe
        return [t for t, _ in probe.steps()], n_params
    return [b - a for a, b in zip(task.stamps, task.stamps[1:], strict=False)], n_params


def gemm_peak(n: int = 1536, reps: int = 6) -> float:
    """Best fp32 matmul rate (FLOP/s) of torch.mm on n x n matrices here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / 3)
    return 2 * n**3 / best


def linear_shapes() -> list[tuple[int, int]]:
    """(in, out) features of every linear layer of the model at SHAPE, in order: the blocks' and the tied
    head's."""
    d = SHAPE["d_model"]
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * SHAPE["n_layer"] + [(d, VOCAB)]


def matmul_ceiling(reps: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of exactly the matmuls of one training step at SHAPE in `dtype` (forward, input and weight
    gradients of every linear layer and the tied head), nothing else: an upper bound on any loop's model
    FLOP rate."""
    tokens = SHAPE["batch"] * SHAPE["context"]
    layers = linear_shapes()
    mats = [
        tuple(torch.randn(*shape, dtype=dtype) for shape in ((tokens, i), (i, o), (tokens, o)))
        for i, o in layers
    ]
    flops = sum(6 * tokens * i * o for i, o in layers)

    def once() -> float:
        t = time.perf_counter()
        for x, w, g in mats:
            torch.mm(x, w)  # forward
            torch.mm(g, w.t())  # input gradient
            torch.mm(x.t(), g)  # weight gradient
        return time.perf_counter() - t

    once()
    return flops / min(once() for _ in range(reps))


def kjv_bytes() -> torch.Tensor:
    """The KJV text as byte ids (the bytes tokenizer's), what the plain loop samples its windows from."""
    from text.corpus import kjv_books
    from text.tokenizer import ByteTokenizer

    return torch.tensor(ByteTokenizer().encode("".join(kjv_books())), dtype=torch.long)


def speed(steps: int, warmup: int, compile_policy: str = "off") -> dict[str, float]:
    """Recipe vs plain loop tokens/s, and both MFUs against the GEMM rate probed right before each step."""
    # the recipe's CPU plan keeps freed memory process-wide (core.device.allocator) once it runs; set it
    # first so both plain loops and the recipe share one heap and only the loops' code differs
    # (bench.mfu times nanoGPT's loop against the recipe on glibc's defaults, as its users run it)
    retain_freed_memory()
    data = kjv_bytes()
    best_peak = gemm_peak()
    probes = [PeakProbe() for _ in range(3)]  # plain before, recipe, plain after
    plain_loop(data, warmup + steps, probes[0])
    with tempfile.TemporaryDirectory() as tmp:
        _, n_params = recipe_loop(warmup + steps, Path(tmp), compile_policy, probes[1])
    plain_loop(data, warmup + steps, probes[2])
    best_peak = max(best_peak, gemm_peak())
    ceiling = matmul_ceiling()
    before, ours, after = (p.steps()[warmup:] for p in probes)
    s = SHAPE
    tokens = s["batch"] * s["context"]
    n = n_params - s["context"] * s["d_model"]  # position embeddings do no matmul work
    flops_per_token = 6 * n + 12 * s["n_layer"] * s["d_model"] * s["context"]

    def tps(pairs: list[tuple[float, float]]) -> float:
        return tokens / statistics.median(t for t, _ in pairs)

    def mfu(pairs: list[tuple[float, float]]) -> float:
        return statistics.median(tokens * flops_per_token / (t * rate) for t, rate in pairs)

    plain_tps = statistics.mean([tps(before), tps(after)])
    ours_tps = tps(ours)
    probed = statistics.median(rate for p in (before, ours, after) for _, rate in p)
    out = {
        "gemm_peak_gflops": best_peak / 1e9,
        "gemm_probed_median_gflops": probed / 1e9,
        "plain_tokens_per_s": plain_tps,
        "plain_before_tokens_per_s": tps(before),
        "plain_after_tokens_per_s": tps(after),
        "recipe_tokens_per_s": ours_tps,
        "recipe_over_plain": ours_tps / plain_tps,
        "plain_gflops": plain_tps * flops_per_token / 1e9,
        "recipe_gflops": ours_tps * flops_per_token / 1e9,
        "plain_mfu": statistics.mean([mfu(before), mfu(after)]),
        "recipe_mfu": mfu(ours),
        "plain_mfu_vs_best_peak": plain_tps * flops_per_token / best_peak,
        "recipe_mfu_vs_best_peak": ours_tps * flops_per_token / best_peak,
        "params_m": n_params / 1e6,
        "matmul_ceiling_gflops": ceiling / 1e9,
        "matmul_ceiling_mfu": ceiling / best_peak,
        "timed_steps": steps,
    }
    print(
        f"speed  GEMM rate probed before each step: median {probed / 1e9:.1f} GFLOP/s (best of run "
        f"{best_peak / 1e9:.1f}) | plain {plain_tps:.0f} tok/s (before {tps(before):.0f}, "
        f"after {tps(after):.0f}), MFU {out['plain_mfu']:.1%} | recipe {ours_tps:.0f} tok/s, "
        f"MFU {out['recipe_mfu']:.1%} (target >= 80%; vs best peak {out['recipe_mfu_vs_best_peak']:.1%}) "
        f"| recipe/plain {out['recipe_over_plain']:.3f}x (target >= 0.95) | the step's matmuls alone "
        f"{ceiling / 1e9:.1f} GFLOP/s = {out['matmul_ceiling_mfu']:.1%} of best peak (MFU ceiling)",
        flush=True,
    )
    return out
