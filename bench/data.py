"""Data larger than memory, measured side by side in one run (issue #40 point 5): the `data=tokens` loader
against the LM step it feeds, resident memory as the corpus grows, and prepare's throughput per core.

    PYTHONPATH=. python -m bench.data [--memory-log2 24,25,26,27] [--prepare-mb 32] [OVERRIDE ...]

1. Loader vs step: tokens/s of `TokenWindows` over a prepared `ShardSet` through `PermutedBatchSampler` and a
   DataLoader in the training process (no workers, as the recipe builds it on a CPU host), no model; beside it
   tokens/s of the `+task=lm` recipe's model (conf/, plus Hydra-style OVERRIDEs) taking the task's `step`,
   backward and an AdamW step, fp32 on the CPU, on batches of that loader at the same shape. Goal: >= 10x.
2. Memory: for each corpus size (2^N bytes of generated text, about as many tokens, prepared once with
   tokenizer=bytes into a temporary folder), a child process of its own builds the dataset, sampler and
   loader and reads --memory-batches batches, the page cache dropped first where root may (so the shards
   are read from the disk, as a corpus larger than memory is); its VmHWM (peak RSS: the interpreter's and
   torch's own, and the shard pages it mapped in) is the figure, with the MiB it read from the disk, and
   beside it RssAnon at the end (the process's own memory without the file-backed pages, which are page
   cache the kernel reclaims under pressure). Goal: flat,
   the largest size ~1.0x the smallest.
3. Prepare: MB/s of generated text through `text.prepare.prepare` (tokenizer=bytes, both passes, no torch
   import: the command's own start is not timed) with workers=1 (in-process) and workers=2 (a pool), per core.

The corpus is lowercase letters and spaces in JSONL documents of --doc-bytes: the byte tokenizer's speed and
the loader's do not depend on the letters. Ratios are of figures from this one run, on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.cpuload import usable_cpus

if TYPE_CHECKING:  # torch and the recipe's stack load in the functions: the parent's prepare imports neither
    from torch.utils.data import DataLoader


HEADER = "| part | what | figure | unit | ratio |"


def host_facts() -> str:
    """CPU model, family/model, the vector flags that matter, usable cores and the load average."""
    info: dict[str, str] = {}
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block describes them all
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    flags = set(info.get("flags", "").split())
    vector = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none"
    cores = usable_cpus()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return (
        f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}; {vector}); {cores} usable cores; load average {load}"
    )


def python_in_fresh_process(code: str, env: dict[str, str] | None = None) -> str:
    """The last line `code` prints, run by a fresh interpreter with the repository on PYTHONPATH and `env`
    added (this process's settings, e.g. its heap policy, do not reach it); its stderr's tail on failure."""
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full)
    if done.returncode != 0:
        raise SystemExit(f"a fresh process failed:\n{done.stderr[-3000:]}")
    return done.stdout.splitlines()[-1]


def write_corpus(folder: Path, n_bytes: int, *, file_bytes: int, doc_bytes: int, seed: int = 0) -> int:
    """JSONL files of `doc_bytes`-character documents (lowercase letters and spaces) totalling about
    `n_bytes` of text, `file_bytes` a file (prepare tokenizes a file in one worker); returns the bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    written, k = 0, 0
    while written < n_bytes:
        size = min(file_bytes, n_bytes - written)
        text = alphabet[rng.integers(0, len(alphabet), size)].tobytes().decode("ascii")
        with (folder / f"part-{k:05d}.jsonl").open("w", encoding="ascii") as f:
            for s in range(0, size, doc_bytes):
                # a leading letter: a document of spaces alone would be "empty" and skipped
                f.write('{"text": "x' + text[s + 1 : s + doc_bytes] + '"}\n')
        written, k = written + size, k + 1
    return written


def prepare_folder(root: Path, out: Path, *, workers: int, shard_tokens: int) -> float:
    """Prepare `root` into `out` with tokenizer=bytes; returns the wall seconds."""
    from text.prepare import prepare

    start = time.perf_counter()
    prepare(str(root), str(out), workers=workers, shard_tokens=shard_tokens, progress=False)
    return time.perf_counter() - start


def token_loader(path: Path, context: int, batch: int, seed: int = 0) -> tuple[DataLoader, int]:
    """The recipe's `data=tokens` training loader over `path` (no workers) and its train split's tokens."""
    from torch.utils.data import DataLoader

    from core.data.samplers import PermutedBatchSampler
    from text.lm_data import TokenWindows
    from text.token_shards import ShardSet

    split = ShardSet(path).train
    windows = TokenWindows(split, context)
    sampler = PermutedBatchSampler(len(windows), batch, shuffle=True, seed=seed, drop_last=False)
    return DataLoader(windows, batch_sampler=sampler, num_workers=0), split.tokens


def _cycle(loader: DataLoader, n: int) -> list[Any]:
    """The first `n` batches, the epoch restarted if it is shorter."""
    out: list[Any] = []
    while len(out) < n:
        for b in loader:
            out.append(b)
            if len(out) == n:
                break
    return out


def loader_rate(path: Path, context: int, batch: int, batches: int) -> float:
    """Input tokens/s of the loader alone over `batches` batches (its first batch untimed)."""
    loader, _ = token_loader(path, context, batch)
    it = iter(loader)
    next(it)  # maps the first shard and builds the epoch's order
    start, tokens, done = time.perf_counter(), 0, 0
    while True:
        for x, _, _ in it:
            tokens += x.numel()
            done += 1
            if done == batches:
                return tokens / (time.perf_counter() - start)
        it = iter(loader)  # the epoch ended first: the next one


def step_rate(path: Path, overrides: list[str], steps: int) -> tuple[float, str]:
    """Input tokens/s of the LM recipe's step (task.step, backward, AdamW) on the loader's batches, fp32 on
    the CPU (one warm-up step untimed), and a line naming the model and shape."""
    import torch

    from bench.generate import lm_task
    from core.optim import OptimConfig, build_optimizer

    task, cfg = lm_task(overrides)
    context, batch = int(cfg.task.context), int(cfg.trainer.batch_size)
    torch.manual_seed(0)
    model = task.build_model().train()
    opt = build_optimizer(model, OptimConfig(lr=float(cfg.optim.lr)))
    loader, _ = token_loader(path, context, batch)
    batches = _cycle(loader, steps + 1)  # read ahead: the step's rate leaves the loader out
    tokens, start = 0, 0.0
    for k, b in enumerate(batches):
        if k == 1:
            start = time.perf_counter()
        task.step(model, b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        tokens += b[0].numel() if k else 0
    rate = tokens / (time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    shape = (
        f"GPT {len(model.blocks)} layers x {model.tok_emb.embedding_dim} wide ({params / 1e6:.2f} M params), "
        f"context {context}, batch {batch}, fp32, {torch.get_num_threads()} threads"
    )
    return rate, shape


def memory_child(path: Path, context: int, batch: int, batches: int, cold: bool = True) -> dict[str, float]:
    """In a process of its own: build the loader over `path`, read `batches` batches; the peak RSS, and the
    anonymous and file-backed parts of the RSS at the end."""
    cold = cold and drop_caches()  # the shards as a corpus larger than memory meets them: on disk, not cached
    loader, tokens = token_loader(path, context, batch)
    before = _read_bytes()
    _cycle(loader, batches)
    read_mib = (_read_bytes() - before) / 2**20
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    if "VmHWM" not in status:
        raise SystemExit("/proc/self/status has no VmHWM: the measurement needs Linux")
    mib = {k: int(status[k].split()[0]) / 1024 for k in ("VmHWM", "RssAnon", "RssFile")}
    # RssFile counts the shard pages mapped in, fault-around's neighbours included: page cache the kernel
    # reclaims under pressure, unlike RssAnon, so the two are reported apart
    return {
        "tokens": tokens,
        "peak_rss_mib": mib["VmHWM"],
        "anon_mib": mib["RssAnon"],
        "file_mib": mib["RssFile"],
        "read_mib": read_mib,
        "cold": cold,
    }


def drop_caches() -> bool:
    """Drop the page cache (root, where the kernel allows it); whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (/proc/self/io; 0 where it is not kept)."""
    try:
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(io["read_bytes"])
    except (OSError, KeyError, ValueError):
        return 0


def _fmt(x: float) -> str:
    return f"{x / 1e6:,.2f} M" if x >= 1e6 else f"{x / 1e3:,.1f} k"


def _times(ratio: float) -> str:
    """A ratio as 'Nx': whole from 10 up, else 3 significant digits (0.48x, never a rounded 0x)."""
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.3g}x"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-log2", default="24,25,26,27", help="corpus sizes, log2 of the tokens")
    p.add_argument("--memory-batches", type=int, default=200)
    p.add_argument(
        "--prepare-mb", type=float, default=32.0, help="MB of text for the prepare and loader parts"
    )
    p.add_argument("--file-mb", type=float, default=4.0, help="MB of text per source file")
    p.add_argument("--doc-bytes", type=int, default=4096)
    p.add_argument("--shard-log2", type=int, default=24, help="log2 of the tokens per shard")
    p.add_argument("--loader-batches", type=int, default=1000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workdir", default="", help="where the corpora go (default: a temporary folder)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--keep-cache", action="store_true", help="leave the page cache (warm memory figures)")
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides of the +task=lm recipe (task.context=256 ...)"
    )
    return p


def _prepare_part(work: Path, args: argparse.Namespace) -> tuple[int, dict[int, float]]:
    """(bytes of text, MB/s by workers): part 3, whose prepared-1 folder the loader part reads."""
    text = work / "text"
    n_bytes = write_corpus(
        text, int(args.prepare_mb * 1e6), file_bytes=int(args.file_mb * 1e6), doc_bytes=args.doc_bytes
    )
    mbps = {}
    for w in (1, 2):
        seconds = prepare_folder(text, work / f"prepared-{w}", workers=w, shard_tokens=1 << args.shard_log2)
        mbps[w] = n_bytes / 1e6 / seconds
    return n_bytes, mbps


def _memory_part(
    work: Path, args: argparse.Namespace, sizes: list[int], context: int, batch: int
) -> list[dict[str, Any]]:
    """Part 2: each corpus size's `memory_child` figures, each size prepared from a prefix of one set of
    files."""
    corpus = work / "corpus"
    # files of a power of two bytes, so each size's prefix is 2^N bytes of text exactly
    part_bytes = 1 << min(min(sizes), max(1, int(args.file_mb * 1e6)).bit_length() - 1)
    write_corpus(corpus, 1 << max(sizes), file_bytes=part_bytes, doc_bytes=args.doc_bytes)
    files = sorted(corpus.iterdir())
    return [_memory_of_size(work, files, n, args, context, batch) for n in sizes]


def _memory_of_size(
    work: Path, files: list[Path], n: int, args: argparse.Namespace, context: int, batch: int
) -> dict[str, Any]:
    """The figures of a child process reading 2^`n` bytes of `files`, prepared."""
    part, prepared = work / f"text-2^{n}", work / f"prepared-2^{n}"
    part.mkdir()
    taken = 0
    for f in files:
        if taken >= 1 << n:
            break
        (part / f.name).symlink_to(f)
        taken += f.stat().st_size
    prepare_folder(part, prepared, workers=0, shard_tokens=1 << args.shard_log2)
    forwarded = [
        f"--memory-batches={args.memory_batches}",
        *(["--keep-cache"] if args.keep_cache else []),
        "--child",
        str(prepared),
        str(context),
        str(batch),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "bench.data", *forwarded],
        check=True,
        stdout=subprocess.PIPE,  # the child's errors reach the terminal
        text=True,
    )
    shutil.rmtree(prepared)  # the next size's shards need the disk more than this one's
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory_rows(
    sizes: list[int], figures: list[dict[str, Any]], batches: int
) -> list[tuple[str, str, float, str, str]]:
    """The table's rows of part 2: peak RSS per size, then RssAnon per size, each against the smallest."""
    rows = []
    for n, r in zip(sizes, figures, strict=True):
        rows.append(
            (
                "memory",
                f"2^{n} bytes of text ({r['tokens']:,} tokens in train), {batches} batches",
                r["peak_rss_mib"],
                "MiB peak RSS",
                f"{r['peak_rss_mib'] / figures[0]['peak_rss_mib']:.2f}x",
            )
        )
    for n, r in zip(sizes, figures, strict=True):
        cache = "cold cache" if r["cold"] else "warm cache"
        beside = f"{r['file_mib']:,.0f} MiB file-backed beside it, {r['read_mib']:,.0f} MiB read ({cache})"
        rows.append(
            (
                "memory, anonymous",
                f"2^{n} bytes of text: {beside}",
                r["anon_mib"],
                "MiB RssAnon",
                f"{r['anon_mib'] / figures[0]['anon_mib']:.2f}x",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the three parts, print the table of figures and ratios; returns the figures by name."""
    args = _parser().parse_args(argv)
    if args.child:  # the recipe's shape comes from the parent: composing it here would weigh on the peak
        context, batch = (int(v) for v in args.overrides)
        figures = memory_child(Path(args.child), context, batch, args.memory_batches, not args.keep_cache)
        print(json.dumps(figures))
        return {}
    from bench.generate import lm_task

    _, cfg = lm_task(args.overrides)
    context, batch = int(cfg.task.context), int(cfg.trainer.batch_size)
    print(" ".join(["command: python -m bench.data", *(argv if argv is not None else sys.argv[1:])]))
    print(f"host: {host_facts()}")
    work = Path(tempfile.mkdtemp(prefix="bench-data-", dir=args.workdir or None))
    out: dict[str, float] = {}
    try:
        # 3. prepare, first: its output is the loader part's corpus
        n_bytes, mbps = _prepare_part(work, args)
        out["prepare_mb_s_1"], out["prepare_mb_s_2"] = mbps[1], mbps[2]
        # 1. loader vs step, on the same prepared folder and shape
        out["loader_tokens_s"] = loader_rate(work / "prepared-1", context, batch, args.loader_batches)
        out["step_tokens_s"], shape = step_rate(work / "prepared-1", args.overrides, args.steps)
        # 2. memory as the corpus grows
        sizes = [int(s) for s in args.memory_log2.split(",")]
        figures = _memory_part(work, args, sizes, context, batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for n, r in zip(sizes, figures, strict=True):
        out[f"peak_rss_mib_2^{n}"], out[f"anon_rss_mib_2^{n}"] = r["peak_rss_mib"], r["anon_mib"]
    loader = f"{_times(out['loader_tokens_s'] / out['step_tokens_s'])} the step"
    rows = [
        (
            "loader vs step",
            f"loader alone ({n_bytes / 1e6:.1f} MB prepared)",
            out["loader_tokens_s"],
            "tokens/s",
            loader,
        ),
        ("loader vs step", "LM step: " + shape, out["step_tokens_s"], "tokens/s", "1x"),
        *_memory_rows(sizes, figures, args.memory_batches),
    ]
    for w in (1, 2):
        ratio = f"{mbps[w] / mbps[1]:.2f}x"
        rows.append(("prepare", f"workers={w}: {mbps[w] / w:,.1f} MB/s per core", mbps[w], "MB/s", ratio))
    _print_table(rows)
    peaks, anon = [r["peak_rss_mib"] for r in figures], [r["anon_mib"] for r in figures]
    largest, anonymous, speedup = peaks[-1] / peaks[0], anon[-1] / anon[0], mbps[2] / mbps[1]
    print(
        f"loader/step {_times(out['loader_tokens_s'] / out['step_tokens_s'])} (goal >= 10x); peak RSS "
        f"2^{sizes[-1]}/2^{sizes[0]} {largest:.2f}x (goal ~1.0x), anonymous {anonymous:.2f}x; prepare "
        f"workers=2/1 {speedup:.2f}x"
    )
    return out


def _print_table(rows: list[tuple[str, str, float, str, str]]) -> None:
    print(HEADER)
    print("|---|---|---|---|---|")
    for part, what, figure, unit, ratio in rows:
        shown = _fmt(figure) if unit == "tokens/s" else f"{figure:,.1f}"
        print(f"| {part} | {what} | {shown} | {unit} | {ratio} |")


if __name__ == "__main__":
    main()
