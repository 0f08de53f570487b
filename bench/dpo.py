"""Preference tuning against TRL (issue #58 point 4): DPO training tokens/s of `+task=dpo`'s step against
TRL's `DPOTrainer` on the same weights, pairs and precision; peak memory of LoRA DPO against LoRA SFT; and the
precomputed reference's saving, from one run.

`PYTHONPATH=. python -m bench.dpo [--size real|tiny] [--steps 3] [--threads N] [--batch 2]`

The model is the `llama_125m` preset (`--size tiny`: a 2-layer llama of width 32, for the smoke test) with
random weights (seed 0) saved by transformers as a `LlamaForCausalLM` folder, the way `bench.generation` makes
one; ours is built from that folder (`text.pretrained.build_llama`). The batch is fixed: --batch pairs of
random ids, a prompt of --prompt tokens shared by both completions of a pair, each --completion tokens (no
padding). --precision fp32 (default) or bf16: autocast on both sides (ours under the run's device plan,
`core.device`; TRL's `bf16=True`, its default), the weights fp32.

- Speed: one training step of each side, alternated, the order rotating each round, after one untimed step
  each; medians over --steps rounds. Ours: `text.dpo.PreferenceTuning.step` (chosen and rejected in one
  forward, the reference a frozen copy built from the same folder) + backward + AdamW step
  (`core.optim.build_optimizer` at TRL's defaults: lr 1e-6, no weight decay, betas 0.9/0.999). TRL:
  `DPOTrainer.training_step` (its forward, loss and backward; the reference its own frozen copy) + its
  optimizer's step, with DPOConfig's defaults (sigmoid loss, beta 0.1, gradient checkpointing on, as
  `Trainer.train` switches it on) except `bf16` (set to the precision compared) and no logging or saving; and
  again with gradient checkpointing off. Tokens are every token of the 2 x batch rows. Each ratio is the
  median over rounds of that round's ratio (the sides of a round ran within a minute of each other, so a
  load that comes and goes over minutes cancels), printed with its range over the rounds; tokens/s are
  from the median step. The same side with the reference's log-probabilities cached (`task.cached`: what
  `task.precompute_reference=true` leaves before the first step) gives the precomputed reference's
  saving, and the reference's forward alone (`task.reference_forward`, timed as a side) the saving it
  should have: a saving is resolved when its range over the rounds excludes 0.
- Memory: LoRA (rank 8 on q_proj, v_proj) DPO (reference = adapters off, `core.nn.lora.adapters_off`) and
  LoRA SFT (`text.lm.LanguageModeling.step` on the same rows' completion tokens) each in a process of its own:
  peak RSS over the steps (`/proc/self/status` VmHWM, reset by `/proc/self/clear_refs` once the model and
  optimizer are built, so a load's transient copy is not counted; the weights' resident bytes are), and
  that peak less the RSS before the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.generate import load_average

#: --size: (model preset, its size keywords, vocabulary, context, prompt, completion tokens)
SIZES: dict[str, tuple[str, dict[str, int], int, int, int, int]] = {
    "real": ("llama_125m", {}, 50257, 512, 64, 64),
    "tiny": (
        "llama",
        {"n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64},
        300,
        64,
        8,
        8,
    ),
}


def model_section(size: str, folder: Path) -> dict[str, Any]:
    """The `model` config section of `size` loading `folder`."""
    name, sizes, vocab, context, _, _ = SIZES[size]
    return {"name": name, **sizes, "weights": str(folder), "vocab_size": vocab, "context": context}


def save_folder(size: str, folder: Path) -> None:
    """transformers' LlamaForCausalLM of `size`, random weights (seed 0), saved to `folder`."""
    import transformers

    from core.registry import MODELS
    from text.checkpoints.hf import config_for

    name, sizes, vocab, context, _, _ = SIZES[size]
    config = config_for(MODELS.build(name, **sizes, vocab_size=vocab, context=context))
    config.pop("architectures", None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(folder)


def pair_batch(size: str, pairs: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The fixed batch, as TRL's collator gives it (input_ids, attention_mask, completion_mask: chosen rows
    then rejected) and as ours does (`text.preference.collate_pairs`: tokens, targets, pair index)."""
    from text.lm_data import IGNORE

    _, _, vocab, _, prompt, completion = SIZES[size]
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (pairs, prompt), generator=g)
    ids = torch.cat([shared.repeat(2, 1), torch.randint(3, vocab, (2 * pairs, completion), generator=g)], 1)
    completion_mask = torch.zeros_like(ids)
    completion_mask[:, prompt:] = 1
    theirs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion_mask}
    targets = ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, IGNORE)
    return theirs, (ids[:, :-1], targets, torch.arange(pairs))


def dpo_task(size: str, folder: Path, **options: Any) -> Any:
    """`+task=dpo` on the folder's model (its data section is never read here)."""
    from text.dpo import PreferenceTuning

    return PreferenceTuning(model=model_section(size, folder), data={"name": "preference"}, **options)


def build_ours(size: str, folder: Path) -> Any:
    """Ours built from `folder` (`text.pretrained.build_llama`), in training mode."""
    from text.pretrained import build_llama

    section = model_section(size, folder)
    section.pop("name")
    return build_llama(**section).train()


def our_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters at TRL's DPOConfig defaults (lr 1e-6, no weight decay)."""
    from core.optim import OptimConfig, build_optimizer

    return build_optimizer(model, OptimConfig(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999)))


def autocast(precision: str) -> Callable[[], Any]:
    """The CPU device plan's autocast context of `precision` (`core.device.resolve`)."""
    from core.device import resolve

    return resolve("cpu", precision).autocast


def our_steps(
    size: str, folder: Path, batch: tuple[torch.Tensor, ...], precision: str
) -> dict[str, Callable[[], None]]:
    """Our DPO step with the frozen-copy reference, with the reference's log-probabilities cached, and
    the frozen-copy reference's forward alone (what the cache saves)."""
    task, model = dpo_task(size, folder), build_ours(size, folder)
    task.initial = build_ours(size, folder)  # the reference's source, as task._initial_model builds it
    opt = our_optimizer(model)
    tokens, targets, index = batch
    with torch.no_grad(), autocast(precision)():
        reference = task.reference_forward(model, tokens, targets).double()
    cached = torch.stack(reference.chunk(2), dim=1)

    def step(cache: torch.Tensor | None) -> Callable[[], None]:
        def run() -> None:
            task.cached = cache
            with autocast(precision)():
                loss = task.step(model, batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        return run

    def reference() -> None:
        with torch.no_grad(), autocast(precision)():
            task.reference_forward(model, tokens, targets)

    return {
        "torchkiln": step(None),
        "torchkiln precomputed reference": step(cached),
        "torchkiln reference forward alone": reference,
    }


def trl_steps(
    folder: Path, out: Path, inputs: dict[str, torch.Tensor], vocab: int, precision: str
) -> dict[str, Callable[[], None]]:
    """TRL's DPOTrainer step at its defaults (gradient checkpointing on), and with checkpointing off."""
    import datasets
    import tokenizers
    import transformers
    import trl

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, said every step
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="t1", pad_token="t0", unk_token="t2"
    )
    rows = datasets.Dataset.from_list([{"prompt": "t5 t6", "chosen": " t7", "rejected": " t8"}] * 2)
    bf16 = precision == "bf16"
    args = trl.DPOConfig(
        output_dir=str(out / "trl"), report_to=[], use_cpu=True, bf16=bf16, save_strategy="no"
    )
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # as Trainer.train sets it: no accumulation
    # bf16: torch's CPU autocast, which accelerate wraps the model's forward in when Trainer.train prepares it
    context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step(checkpointing: bool) -> Callable[[], None]:
        def run() -> None:
            if checkpointing:  # as Trainer.train switches it on
                trainer.model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
            else:
                trainer.model.gradient_checkpointing_disable()
            with context:
                trainer.training_step(trainer.model, dict(inputs))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=False)

        return run

    assert args.gradient_checkpointing, "DPOConfig's default is gradient checkpointing on"
    return {"TRL DPOTrainer (defaults)": step(True), "TRL DPOTrainer, no checkpointing": step(False)}


#: per side, each round's (wall, CPU) seconds
Rounds = dict[str, list[tuple[float, float]]]


def timed(run: dict[str, Callable[[], None]], rounds: int) -> Rounds:
    """Each side's (wall, CPU) step seconds in each of `rounds` rotated rounds, after one untimed each."""
    names, times = list(run), {name: [] for name in run}
    for name in names:
        run[name]()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            run[name]()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def paired(times: Rounds, over: str, under: str, clock: int) -> tuple[float, float, float]:
    """(median, least, most) over the rounds of side `over`'s seconds / side `under`'s, on `clock` (0 wall,
    1 CPU)."""
    ratios = [a[clock] / b[clock] for a, b in zip(times[over], times[under], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}: the measurement needs Linux")


def memory_child(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """One LoRA mode's steps (`--child dpo|sft`): peak RSS over them and that peak less the RSS before."""
    from core.distributed import MeshShape
    from core.distributed.parallelize import parallelize
    from core.nn.lora import LoRAConfig
    from text.lm import LanguageModeling

    task = dpo_task(args.size, folder)
    model = parallelize(build_ours(args.size, folder), MeshShape(), lora=LoRAConfig(rank=8))
    opt = our_optimizer(model)
    batch = pair_batch(args.size, args.batch)[1]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the steps' peak
    before = _vm_kib("VmRSS")
    if args.child == "sft":  # the same rows' completion tokens, no document ids
        step, batch = LanguageModeling.step.__get__(task), (*batch[:2], None)
    else:
        step = task.step
    for _ in range(args.steps):
        with autocast(args.precision)():
            loss = step(model, batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    peak = _vm_kib("VmHWM")
    return {"peak_mib": peak / 1024, "over_start_mib": (peak - before) / 1024}


def memory(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, float]]:
    """Each LoRA mode's memory figures, each from a process of its own."""
    out = {}
    for mode in ("dpo", "sft"):
        command = [sys.executable, "-m", "bench.dpo", "--size", args.size, "--batch", str(args.batch)]
        command += ["--steps", str(args.steps), "--threads", str(args.threads), "--folder", str(folder)]
        command += ["--precision", args.precision]
        done = subprocess.run([*command, "--child", mode], check=True, stdout=subprocess.PIPE, text=True)
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def speed_report(size: str, batch: int, times: Rounds) -> None:
    """Print each side's tokens/s, the ratios to ours, and the precomputed reference's saving."""
    _, _, _, _, prompt, completion = SIZES[size]
    tokens = 2 * batch * (prompt + completion)
    print("| side | step s (median) | tokens/s | side s / ours, wall (range) | side s / ours, CPU (range) |")
    print("|---|---|---|---|---|")
    for name, rounds in times.items():
        wall = statistics.median(w for w, _ in rounds)
        ratios = [paired(times, name, "torchkiln", clock) for clock in (0, 1)]
        cells = " | ".join(f"{m:.2f}x ({lo:.2f}-{hi:.2f})" for m, lo, hi in ratios)
        print(f"| {name} | {wall:.3f} | {tokens / wall:.1f} | {cells} |")
    for clock, label in ((0, "wall"), (1, "CPU s")):
        cut = [1 - r for r in paired(times, "torchkiln precomputed reference", "torchkiln", clock)]
        alone = paired(times, "torchkiln reference forward alone", "torchkiln", clock)
        print(
            f"precomputed reference, {label}: step {cut[0]:.0%} shorter (rounds {cut[2]:.0%} to "
            f"{cut[1]:.0%}); the reference forward alone is {alone[0]:.0%} of the step "
            f"({alone[1]:.0%} to {alone[2]:.0%})"
        )


def report(size: str, batch: int, times: Rounds, mem: dict[str, Any]) -> None:
    """Print the speed table and ratios, and the memory table."""
    speed_report(size, batch, times)
    print("| LoRA mode | peak RSS MiB | peak over start MiB |")
    print("|---|---|---|")
    for mode, r in mem.items():
        print(f"| {mode} | {r['peak_mib']:.0f} | {r['over_start_mib']:.0f} |")
    dpo, sft = mem["dpo"], mem["sft"]
    ratio, over = dpo["peak_mib"] / sft["peak_mib"], dpo["over_start_mib"] / max(sft["over_start_mib"], 1e-9)
    print(f"LoRA DPO / LoRA SFT peak RSS: {ratio:.3f}x (over start: {over:.2f}x)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the model and host, the speed table and ratios, and the LoRA memory table; return each side's
    (wall, CPU) step seconds in each round and each LoRA mode's memory figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="real")
    for flag, default in (("--steps", 3), ("--threads", 0), ("--batch", 2)):
        ap.add_argument(flag, type=int, default=default)  # --threads 0: torch's default
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--child", choices=("dpo", "sft"))
    ap.add_argument("--folder", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    import text  # noqa: F401  (registers the llama presets)

    if args.child:
        print(json.dumps(memory_child(args, args.folder)))
        return {}
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        folder = Path(tmp) / "hf"
        save_folder(args.size, folder)
        theirs, ours = pair_batch(args.size, args.batch)
        name, _, vocab, _, prompt, completion = SIZES[args.size]
        print(
            f"{name} ({args.size}): {args.batch} pairs of prompt {prompt} + completion {completion} "
            f"tokens, {args.precision}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"load average {load_average()}"
        )
        run = our_steps(args.size, folder, ours, args.precision)
        run |= trl_steps(folder, Path(tmp), theirs, vocab, args.precision)
        times = timed(run, args.steps)
        mem = memory(args, folder)
    report(args.size, args.batch, times, mem)
    print(f"load average {load_average()} at the end; {args.steps} rounds, order rotated each round")
    return {"seconds": times, "memory": mem}


if __name__ == "__main__":
    main()
