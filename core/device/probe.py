"""Measured CPU precision: fp32 against bf16 autocast (and oneDNN bf16 fast math where the plan would use it)
timed on small training steps, once per machine, in a child process, and cached as JSON.

A cpuinfo flag says what a CPU can decode, not what is fast: on a Xeon with AVX512-BF16 but no AMX the
recipe models ran slower in bf16 than in fp32 (BENCHMARKS.md § Device precision). So `precision=auto` on a
CPU follows this measurement, and bf16 must win it by `MARGIN`.

The child process keeps the measurement from touching the caller: no oneDNN primitive is built there before
`plan.apply()` sets its environment, and the thread count and fast-math flags it flips are its own.
Run `python -m core.device.probe --threads N` to see what the child prints.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from core.cpuload import OthersLoad, busy_cpus, loaded
from core.device.facts import CpuFacts
from core.files import cache_root, locked, write_text_atomic

#: bumped when the cases or the rule change, so older measurements are taken again
PROBE_VERSION = 1
#: bf16 (or fast math) must be this much faster than fp32, geometric mean over the cases. Below it the gain
#: is within run-to-run noise; and keeping fp32 there leaves `auto` at worst 1/MARGIN (0.95x) of the faster.
MARGIN = 1.05
CASES = ("matmul", "conv", "block")
COLUMNS = ("fp32", "bf16", "fast_math")
#: the child's whole run (torch import included) must end within this; a hung child costs a run no more
TIMEOUT_S = 120.0
#: how long `measured` watches the CPUs before measuring again a result taken under load
QUIET_CHECK_S = 0.25


class ProbeError(RuntimeError):
    """The measurement could not be made (the child failed, timed out or printed no result)."""


@dataclass(frozen=True)
class ProbeResult:
    """Median milliseconds per case for each precision column, at the plan's thread count."""

    fingerprint: str
    threads: int
    #: column ("fp32", "bf16", "fast_math") -> case -> median ms
    ms: dict[str, dict[str, float]]
    #: fp32 steps at 1 thread and at `threads` ({"1": ms, "N": ms}); empty when `threads` is 1
    thread_ms: dict[str, float] = field(default_factory=dict)
    #: the child's measuring time (its torch import not included)
    cost_ms: float = 0.0
    torch_version: str = ""
    measured_at: str = ""
    #: CPUs that other processes kept busy while it measured (None: not known, e.g. no /proc/stat)
    others_cpus: float | None = None

    @property
    def under_load(self) -> bool:
        """Whether other processes shared the CPUs while it measured (its thread timings say little)."""
        return loaded(self.others_cpus)

    def speedup(self, column: str) -> float | None:
        """Geometric mean over the cases of fp32 ms / `column` ms; None when the column was not measured."""
        if column not in self.ms:
            return None
        ratios = [self.ms["fp32"][case] / self.ms[column][case] for case in CASES]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    def describe(self, column: str) -> str:
        """'1.52x fp32 (matmul 2.10x, conv 1.48x, block 1.20x)' for the reasons column."""
        per_case = ", ".join(f"{c} {self.ms['fp32'][c] / self.ms[column][c]:.2f}x" for c in CASES)
        return f"{self.speedup(column):.2f}x fp32 ({per_case})"

    @property
    def one_thread_speedup(self) -> float | None:
        """How much faster one thread ran than `threads` (below 1: the planned count is faster)."""
        if not self.thread_ms:
            return None
        return self.thread_ms["N"] / self.thread_ms["1"]

    def as_dict(self) -> dict:
        """JSON-ready measurement, as cached."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ProbeResult:
        """Validate a cached or printed measurement; ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        ms = data.get("ms")
        if not isinstance(ms, dict) or "fp32" not in ms or "bf16" not in ms or set(ms) - set(COLUMNS):
            raise ValueError("'ms' must map fp32, bf16 (and optionally fast_math) to cases")
        for column, cases in ms.items():
            if (
                not isinstance(cases, dict)
                or set(cases) != set(CASES)
                or not all(_positive(v) for v in cases.values())
            ):
                raise ValueError(f"'ms.{column}' must give a positive time for each of {', '.join(CASES)}")
        thread_ms = data.get("thread_ms", {})
        if not isinstance(thread_ms, dict) or (
            thread_ms and (set(thread_ms) != {"1", "N"} or not all(_positive(v) for v in thread_ms.values()))
        ):
            raise ValueError("'thread_ms' must be empty or give positive times for '1' and 'N'")
        threads = data.get("threads")
        if not isinstance(threads, int) or threads < 1 or not isinstance(data.get("fingerprint"), str):
            raise ValueError("'threads' must be a positive integer and 'fingerprint' a string")
        others = data.get("others_cpus")
        if others is not None and not (_positive(others) or others == 0):
            raise ValueError("'others_cpus' must be null or a non-negative number")
        return cls(
            fingerprint=data["fingerprint"],
            threads=threads,
            ms={col: {c: float(v) for c, v in cases.items()} for col, cases in ms.items()},
            thread_ms={k: float(v) for k, v in thread_ms.items()},
            cost_ms=float(data.get("cost_ms", 0.0)),
            torch_version=str(data.get("torch_version", "")),
            measured_at=str(data.get("measured_at", "")),
            others_cpus=None if others is None else float(others),
        )


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def fingerprint(cpu: CpuFacts, torch_version: str, threads: int, fast_math: bool) -> str:
    """Key of a measurement: CPU model and flags, core counts, torch version, thread count, what was timed."""
    key = {
        "probe": PROBE_VERSION,
        "cpu": [
            cpu.arch,
            cpu.vendor,
            cpu.model_name,
            sorted(cpu.flags),
            cpu.logical_cpus,
            cpu.physical_cores,
        ],
        "part": cpu.part,
        "torch": torch_version,
        "threads": threads,
        "fast_math": fast_math,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    """Where the measurement for fingerprint `key` is kept."""
    return cache_root() / "device" / f"precision-probe-{key}.json"


def load_cached(key: str) -> ProbeResult | None:
    """The cached measurement for `key`; None when there is none, or it is damaged or for another machine."""
    try:
        result = ProbeResult.from_dict(json.loads(cache_path(key).read_text()))
    except (OSError, ValueError):  # json.JSONDecodeError is a ValueError
        return None
    return result if result.fingerprint == key else None


def measure(threads: int, fast_math: bool, key: str, timeout: float = TIMEOUT_S) -> ProbeResult:
    """Run the probe in a fresh interpreter and return its validated result (ProbeError on any failure),
    with the CPUs other processes kept busy meanwhile."""
    import core

    here = str(Path(core.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "core.device.probe", "--threads", str(threads), "--key", key]
    if fast_math:
        cmd.append("--fast-math")
    with OthersLoad() as load:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ProbeError(f"precision probe did not finish: {err}") from None
    others = load.cpus
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"precision probe exited {proc.returncode}: {last}")
    try:
        result = ProbeResult.from_dict(json.loads(lines[-1]))
    except ValueError as err:
        raise ProbeError(f"precision probe printed no valid result: {err}") from None
    return replace(result, others_cpus=None if others is None else round(others, 2))


def _quiet(busy_now: float | None) -> bool:
    return host_is_quiet() if busy_now is None else not loaded(busy_now)


def host_is_quiet(seconds: float = QUIET_CHECK_S) -> bool:
    """Whether other processes keep fewer than BUSY_CPUS CPUs busy over the next `seconds` (True where
    that cannot be read)."""
    return not loaded(busy_cpus(seconds))


def measured(
    cpu: CpuFacts, threads: int, fast_math: bool, reprobe: bool = False, busy_now: float | None = None
) -> ProbeResult:
    """This machine's measurement: from the cache, else measured now and cached (ProbeError if it fails).

    One taken under load (the test suite beside it, a build) is used, but is not the machine's truth: the
    next start on a quiet host measures again and replaces it (`busy_now`: the CPUs other processes keep
    busy now, if the caller knows; else they are watched for QUIET_CHECK_S)."""
    key = fingerprint(cpu, torch.__version__, threads, fast_math)
    path = cache_path(key)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked(path.with_suffix(".lock")))
        except OSError:  # a read-only cache dir: measure every run rather than fail
            return measure(threads, fast_math, key)
        cached = None if reprobe else load_cached(key)
        if cached is not None and not (cached.under_load and _quiet(busy_now)):
            return cached
        result = measure(threads, fast_math, key)
        with contextlib.suppress(OSError):  # a full disk costs the next run a measurement, not this its plan
            write_text_atomic(path, json.dumps(result.as_dict(), indent=1))
        return result


# ----------------------------------------------------------------------------------------------- the child


def _cases() -> dict[str, Callable[[], None]]:
    """The timed steps: a bare matmul, a small conv net and a pre-norm transformer block, each fwd+bwd."""
    torch.manual_seed(0)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(32, 32, 3, padding=1)
    )
    images = torch.randn(16, 16, 16, 16)
    block = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
    tokens = torch.randn(4, 64, 256)

    def matmul() -> None:
        a @ b

    def conv_step() -> None:
        conv.zero_grad(set_to_none=True)
        conv(images).float().square().mean().backward()

    def block_step() -> None:
        block.zero_grad(set_to_none=True)
        block(tokens).float().square().mean().backward()

    return {"matmul": matmul, "conv": conv_step, "block": block_step}


@contextlib.contextmanager
def _column(name: str) -> Iterator[None]:
    """Run the enclosed step as column `name`: fp32, bf16 autocast, or fp32 with oneDNN bf16 fast math."""
    if name == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif name == "fast_math":
        torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "bf16"
        try:
            yield
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = "none"
    else:
        yield


def _run(threads: int, fast_math: bool, key: str, warmup: int = 2, reps: int = 7) -> dict:
    """Interleave every column step by step (so machine noise hits them alike) and take medians."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    cases = _cases()
    columns = ["fp32", "bf16"] + (["fast_math"] if fast_math else [])
    times: dict[str, dict[str, list[float]]] = {col: {c: [] for c in cases} for col in columns}
    for i in range(warmup + reps):
        for case, step in cases.items():
            for col in columns:
                with _column(col):
                    t0 = time.perf_counter()
                    step()
                    elapsed = time.perf_counter() - t0
                if i >= warmup:
                    times[col][case].append(elapsed * 1e3)
    thread_ms: dict[str, float] = {}
    if threads > 1:
        laps: dict[str, list[float]] = {"1": [], "N": []}
        for i in range(warmup + reps):
            for label, n in (("1", 1), ("N", threads)):
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                cases["conv"]()
                cases["block"]()
                if i >= warmup:
                    laps[label].append((time.perf_counter() - t0) * 1e3)
        thread_ms = {k: statistics.median(v) for k, v in laps.items()}
    return ProbeResult(
        fingerprint=key,
        threads=threads,
        ms={col: {c: statistics.median(v) for c, v in per.items()} for col, per in times.items()},
        thread_ms=thread_ms,
        cost_ms=(time.perf_counter() - start) * 1e3,
        torch_version=torch.__version__,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    ).as_dict()


def main(argv: list[str] | None = None) -> int:
    """The child: time the cases and print the result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m core.device.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--fast-math", action="store_true", help="also time fp32 with oneDNN bf16 fast math")
    parser.add_argument("--key", default="", help="the fingerprint to stamp on the result")
    args = parser.parse_args(argv)
    fast_math = args.fast_math and hasattr(torch.backends.mkldnn, "matmul")
    print(json.dumps(_run(max(1, args.threads), fast_math, args.key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
