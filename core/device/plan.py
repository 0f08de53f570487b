"""The device plan: every device decision (device, precision, matmul, threads, loaders, attention, compile)
with the reason for it, derived as a pure function of `DeviceFacts` and the user's overrides."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.device.allocator import heap_policy, retain_freed_memory
from core.device.facts import DeviceFacts, detect
from core.device.probe import MARGIN, ProbeError, ProbeResult, measured
from core.errors import ConfigError, unknown_choice

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class DevicePlan:
    """Every device decision the rest of torchkiln reads, with a reason for each (`reasons[key]`)."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    grad_scaler: bool
    pin_memory: bool
    num_workers: int
    optimizer_impl: str
    reasons: dict[str, str] = field(default_factory=dict)
    param_dtype: torch.dtype = torch.float32
    #: fp32 matmul/conv mode: "ieee" (full fp32), "tf32" (CUDA Ampere+) or "bf16" (oneDNN fast math)
    matmul_fp32_precision: str = "ieee"
    num_threads: int = 1
    #: environment variables `apply()` exports (never overriding a value the user set)
    env: dict[str, str] = field(default_factory=dict)
    #: `core.attention` backends in the order dispatch should try them
    attention_backends: tuple[str, ...] = ("sdpa", "math")
    #: torch.compile backend; None = stay eager (reason in `reasons["compile"]`)
    compile_backend: str | None = None
    mps_fallback: bool = False
    non_blocking: bool = False
    facts: DeviceFacts | None = None
    #: what was detected for each decision, for the `python -m core.device` table
    detected: dict[str, str] = field(default_factory=dict)
    #: the CPU precision measurement the decisions rest on (None: not measured, priors used)
    probe: ProbeResult | None = None
    #: the heap policy `apply()` sets: "retain" (glibc keeps freed memory, core.device.allocator) or "system"
    allocator: str = "system"

    @property
    def warnings(self) -> tuple[str, ...]:
        """The parts of the reasons flagged as warnings, for the training loop to print."""
        parts = (part.strip() for why in self.reasons.values() for part in why.split(";"))
        # without the flag: the loop prints each as "warning: ...", once
        return tuple(part.removeprefix("WARNING:").strip() for part in parts if part.startswith("WARNING"))

    @property
    def precision(self) -> str:
        """The chosen precision by name: fp32, bf16 or fp16."""
        return _DTYPE_NAMES[self.autocast_dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast context for forward passes under this plan (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def place(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The model `build` returns, on this plan's device; one too large for memory is a ConfigError (exit
        2), raised when its first tensor cannot be allocated (built or moved), before any data is read."""
        try:
            return build().to(self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) and the CPU allocator's error are both
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            m = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGT]iB)", str(e), re.IGNORECASE)
            asked = (f"{int(m[1]) / 2**30:.1f} GiB" if m[1] else m[2]) if m else "more than there is"
            raise ConfigError(
                f"the model does not fit in {self.device.type} memory (one tensor asked for {asked}); "
                "lower the model's sizes (model.*) or the task's sequence length"
            ) from None

    def make_grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler for this device, enabled only when the plan needs one (fp16)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.grad_scaler)

    def apply(self) -> None:
        """Apply the process-wide runtime settings: environment, fp32 matmul mode, thread count and heap
        policy.

        Call it first thing, before any tensor work: oneDNN reads LRU_CACHE_CAPACITY and
        DNNL_DEFAULT_FPMATH_MODE when it builds its first primitive. Variables the user exported win.
        """
        global _applied
        for key, value in self.env.items():
            os.environ.setdefault(key, value)
        _set_matmul_precision(self)
        torch.set_num_threads(self.num_threads)
        if self.allocator == "retain":
            retain_freed_memory()
        _applied = self

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready plan: decisions, reasons and the facts they came from."""
        return {
            "device": str(self.device),
            "precision": self.precision,
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch.")
            if self.autocast_dtype
            else None,
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "grad_scaler": self.grad_scaler,
            "matmul_fp32_precision": self.matmul_fp32_precision,
            "num_threads": self.num_threads,
            "env": dict(self.env),
            "pin_memory": self.pin_memory,
            "non_blocking": self.non_blocking,
            "num_workers": self.num_workers,
            "optimizer_impl": self.optimizer_impl,
            "attention_backends": list(self.attention_backends),
            "compile_backend": self.compile_backend,
            "mps_fallback": self.mps_fallback,
            "allocator": self.allocator,
            "reasons": dict(self.reasons),
            "detected": dict(self.detected),
            "facts": self.facts.as_dict() if self.facts else None,
            "probe": self.probe.as_dict() if self.probe else None,
        }

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(setting, detected, chosen, why) rows for the printed table."""
        chosen = {
            "device": str(self.device),
            "precision": f"{self.precision} autocast" if self.autocast_dtype else "fp32 (no autocast)",
            "grad_scaler": "yes" if self.grad_scaler else "no",
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "matmul": self.matmul_fp32_precision,
            "threads": str(self.num_threads),
            "env": " ".join(f"{k}={v}" for k, v in self.env.items()) or "-",
            "data_loading": f"workers={self.num_workers} pin_memory={self.pin_memory}",
            "optimizer": f"AdamW {self.optimizer_impl}",
            "attention": " > ".join(self.attention_backends),
            "compile": self.compile_backend or "eager",
            "mps_fallback": "on" if self.mps_fallback else "off",
            "allocator": self.allocator,
        }
        return [(k, self.detected.get(k, ""), v, self.reasons.get(k, "")) for k, v in chosen.items()]

    def table(self) -> str:
        """The plan as an aligned text table."""
        rows = [("setting", "detected", "chosen", "why"), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
        lines.insert(1, "-" * min(160, len(lines[0]) + 40))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line for run logs."""
        return (
            f"device={self.device} precision={self.precision} matmul={self.matmul_fp32_precision} "
            f"threads={self.num_threads} optimizer={self.optimizer_impl} "
            f"compile={self.compile_backend or 'eager'} allocator={self.allocator}"
        )


#: the plan `apply()` last made process-wide; readers (attention dispatch) follow it instead of re-planning
_applied: DevicePlan | None = None


def applied_plan() -> DevicePlan | None:
    """The plan this process last applied with `DevicePlan.apply()`, None before any."""
    return _applied


def _set_matmul_precision(plan: DevicePlan) -> None:
    """Set TF32 / oneDNN bf16 fast math through the API the installed torch has (never mixing old and new)."""
    facts, mode, kind = plan.facts, plan.matmul_fp32_precision, plan.device.type
    if kind == "cuda":
        # simulated facts may claim an API this torch lacks (tests on the legacy stack); ask torch as well
        if (facts is None or facts.cuda_fp32_precision_api) and hasattr(
            torch.backends.cuda.matmul, "fp32_precision"
        ):
            # torch >= 2.9 raises when the legacy allow_tf32 flags and the fp32_precision API are mixed
            torch.backends.cuda.matmul.fp32_precision = mode
            torch.backends.cudnn.conv.fp32_precision = mode
        else:
            torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
            torch.backends.cudnn.allow_tf32 = mode == "tf32"
    elif (
        kind == "cpu"
        and (facts is None or facts.mkldnn_fp32_precision_api)
        and hasattr(torch.backends.mkldnn, "matmul")
    ):
        # "ieee" here restores the default; the env-var route (older torch) is in `plan.env`
        torch.backends.mkldnn.matmul.fp32_precision = mode if mode == "bf16" else "none"
        torch.backends.mkldnn.conv.fp32_precision = mode if mode == "bf16" else "none"


def available_devices(facts: DeviceFacts) -> list[str]:
    """Device specs usable here, e.g. ['cpu', 'cuda', 'cuda:0', 'mps']."""
    out = ["cpu"]
    if facts.cuda:
        out += ["cuda"] + [f"cuda:{c.index}" for c in facts.cuda]
    if facts.mps_available:
        out.append("mps")
    return out


def _pick_device(facts: DeviceFacts, spec: str) -> tuple[torch.device, str, str]:
    spec = spec.strip().lower()
    found = [c.describe() for c in facts.cuda]
    detected = f"CUDA: {', '.join(found) or 'none'}; MPS: {'yes' if facts.mps_available else 'no'}"
    if not re.fullmatch(r"auto|cpu|mps(:0)?|cuda(:\d+)?", spec):
        raise unknown_choice("device", spec, ("auto", "cpu", "cuda", "cuda:N", "mps"))
    if spec == "auto":
        if facts.cuda:
            index = facts.local_rank % len(facts.cuda)
            return torch.device("cuda", index), detected, f"auto: CUDA first; cuda:{index} for local rank"
        if facts.mps_available:
            return torch.device("mps"), detected, "auto: no CUDA; Apple MPS is available"
        return torch.device("cpu"), detected, "auto: no CUDA or MPS here"
    avail = available_devices(facts)
    if spec.split(":")[0] not in avail or (":" in spec and spec != "mps:0" and spec not in avail):
        raise ConfigError(
            f"device={spec} is not available here; available: {', '.join(avail)}",
            key="device",
            value=str(spec),
            valid=avail,
        )
    if spec == "cuda":
        index = facts.local_rank % len(facts.cuda)
        return torch.device("cuda", index), detected, f"device=cuda asked; cuda:{index} for local rank"
    return (
        torch.device(spec.removesuffix(":0") if spec == "mps:0" else spec),
        detected,
        f"device={spec} asked",
    )


def _precisions(
    facts: DeviceFacts, device: torch.device, probe: ProbeResult | None, unmeasured: str
) -> tuple[list[str], str, str, str]:
    """(available precisions, auto choice, why, detected) for `device`."""
    if device.type == "cuda":
        cuda = facts.cuda[device.index or 0]
        cap = cuda.capability
        detected = f"{cuda.name} (sm{cap[0]}{cap[1]})"
        if cap >= (8, 0):
            return (
                ["fp32", "bf16", "fp16"],
                "bf16",
                "sm80+ has bf16 tensor cores; bf16 needs no loss scaling",
                detected,
            )
        if cap >= (7, 0):
            why = "sm7x has fp16 tensor cores but no native bf16; fp16 needs a GradScaler"
            return ["fp32", "fp16"], "fp16", why, detected
        return (
            ["fp32", "fp16"],
            "fp32",
            "pre-Volta GPU: no tensor cores, mixed precision gains little",
            detected,
        )
    if device.type == "mps":
        detected = f"MPS bf16: {'yes' if facts.mps_bf16 else 'no (needs macOS 14+)'}"
        if not facts.mps_autocast:
            return ["fp32"], "fp32", f"torch {facts.torch_version} has no autocast for MPS", detected
        if facts.mps_bf16:
            return (
                ["fp32", "bf16", "fp16"],
                "bf16",
                "MPS supports bf16 here; bf16 needs no loss scaling",
                detected,
            )
        why = "MPS bf16 is unavailable here (needs macOS 14+); fp16 autocast is opt-in with precision=fp16"
        return ["fp32", "fp16"], "fp32", why, detected
    cpu = facts.cpu
    detected = cpu.describe()
    if facts.cpu_capability:
        detected += f"; torch CPU kernels: {facts.cpu_capability}"
    avail = ["fp32", "bf16"] + (["fp16"] if cpu.fp16 else [])
    if probe is not None:
        detected += f"; probe of {probe.measured_at}, {probe.cost_ms:.0f} ms"
        if probe.under_load:
            detected += f", under load ({probe.others_cpus:.1f} CPUs busy with other processes)"
        measured_why = f"measured bf16 autocast at {probe.describe('bf16')}"
        if probe.speedup("bf16") >= MARGIN:
            return avail, "bf16", f"{measured_why}, past the {MARGIN:.2f}x it must win by", detected
        return avail, "fp32", f"{measured_why}, short of the {MARGIN:.2f}x it must win by", detected
    if cpu.graviton and cpu.bf16:
        # the one prior that is not fp32: AWS's Graviton guidance, from their measurements of these cores
        return avail, "bf16", f"{unmeasured}; Graviton3+ prior (AWS guidance): Arm BF16 autocast", detected
    return avail, "fp32", f"{unmeasured}; fp32 until bf16 is measured faster here", detected


def _matmul_mode(
    facts: DeviceFacts, device: torch.device, precision: str, probe: ProbeResult | None
) -> tuple[str, str, str]:
    """(mode, why, detected) for fp32 matmuls outside autocast."""
    if device.type == "cuda":
        cap = facts.cuda[device.index or 0].capability
        detected = f"sm{cap[0]}{cap[1]}"
        if cap < (8, 0):
            return "ieee", "TF32 needs Ampere (sm80) or newer", detected
        if precision == "fp32":
            return "ieee", "precision=fp32 asked: TF32 off, full fp32 matmuls and convs", detected
        return "tf32", "Ampere+ runs fp32 matmuls/convs as TF32 on tensor cores (10-bit mantissa)", detected
    if device.type == "cpu" and facts.cpu.graviton:
        gen = facts.cpu.graviton
        detected = f"Graviton{gen} class, bf16 flag: {'yes' if 'bf16' in facts.cpu.flags else 'no'}"
        if gen < 3 or "bf16" not in facts.cpu.flags:
            return "ieee", "bf16 fast math needs Graviton3+ (Arm BF16 instructions)", detected
        if precision == "fp32":
            return "ieee", "precision=fp32 asked: oneDNN bf16 fast math off", detected
        via = (
            "torch.backends.mkldnn.matmul.fp32_precision"
            if facts.mkldnn_fp32_precision_api
            else "DNNL_DEFAULT_FPMATH_MODE=BF16 (this torch lacks mkldnn.matmul.fp32_precision)"
        )
        if probe is not None and probe.speedup("fast_math") is not None:
            measured_why = f"measured oneDNN bf16 fast math at {probe.describe('fast_math')}"
            if probe.speedup("fast_math") < MARGIN:
                return "ieee", f"{measured_why}, short of {MARGIN:.2f}x: overrules AWS guidance", detected
            return "bf16", f"{measured_why}, past {MARGIN:.2f}x; via {via}", detected
        return (
            "bf16",
            f"Graviton3+: oneDNN runs fp32 matmuls/convs with bf16 fast math (AWS guidance), via {via}",
            detected,
        )
    return "ieee", "fp32 matmuls stay full precision on this device", ""


def _threads_and_env(
    facts: DeviceFacts, matmul: str, mps_fallback: bool, device: torch.device, probe: ProbeResult | None
) -> tuple[int, dict[str, str], str, str, str]:
    """(threads, env, why_threads, why_env, detected_threads)."""
    cpu, user = facts.cpu, facts.user_env
    detected = (
        f"{cpu.logical_cpus} logical / {cpu.physical_cores} physical cores usable, "
        f"{facts.local_world_size} local process(es)"
    )
    if "OMP_NUM_THREADS" in user and user["OMP_NUM_THREADS"].isdigit() and int(user["OMP_NUM_THREADS"]) > 0:
        threads = int(user["OMP_NUM_THREADS"])
        why_threads, chosen = f"OMP_NUM_THREADS={threads} set by the user", None
    else:
        threads, why_threads = _threads_per_core(facts, probe)
        chosen = threads
    env, why_env = _exported_env(facts, matmul, mps_fallback, device, chosen)
    return threads, env, why_threads, why_env, detected


def _threads_per_core(facts: DeviceFacts, probe: ProbeResult | None) -> tuple[int, str]:
    """(threads, why) when the user set no OMP_NUM_THREADS: one per physical core a local process has, with
    the warnings the load at start and the probe's thread timings call for."""
    cpu = facts.cpu
    threads = max(1, cpu.physical_cores // facts.local_world_size)
    why = "physical cores / local processes (one OpenMP thread per core, no SMT oversubscription)"
    threads, beside_others = _threads_beside_others(facts, threads)
    why += beside_others
    busy = facts.load_average
    if busy is not None and threads > 1 and busy > 1.5 * cpu.logical_cpus:
        # descheduled OpenMP threads stall every parallel region's barrier: on a shared 2-core host two
        # threads ran far slower than one (BENCHMARKS.md § Device precision, the flag-rule runs).
        # Only a warning: a load-dependent thread count would make launches differ from each other.
        why += (
            f"; WARNING: load average {busy:.1f} on {cpu.logical_cpus} CPUs, another workload shares "
            "them: OMP_NUM_THREADS=1 is likely faster here"
        )
    return threads, why + _probe_thread_note(probe, threads)


def _threads_beside_others(facts: DeviceFacts, threads: int) -> tuple[int, str]:
    """(threads, note for their reason) given the CPUs other processes kept busy at start."""
    # Other processes busy at start (our sibling ranks, importing alongside, excepted): a thread that
    # shares its core with them is descheduled for whole time slices, and every parallel region's
    # barrier waits for it (BENCHMARKS.md § Threads under load). The count stays a function of the
    # hardware unless the user opts in (TORCHKILN_THREADS=load): two runs that chose different counts
    # are not bit-identical (reductions split differently), and resume must stay bit-exact.
    cpu, user, procs = facts.cpu, facts.user_env, facts.local_world_size
    if facts.busy_cpus is None or threads <= 1:
        return threads, ""
    others = max(0.0, facts.busy_cpus - (procs - 1))
    free = max(1, int(min(cpu.physical_cores, cpu.logical_cpus - others) + 0.5) // procs)
    if free >= threads:
        return threads, ""
    busy = f"{others:.1f} of {cpu.logical_cpus} CPUs were busy with other processes at start"
    if user.get("TORCHKILN_THREADS") == "load":
        return free, f"; {busy} and TORCHKILN_THREADS=load: {free} instead of {threads}"
    if user.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return threads, (
            f"; {busy}: OpenMP waits passively (OMP_WAIT_POLICY=PASSIVE), so {threads} threads keep their "
            "speed"
        )
    return threads, (
        f"; WARNING: {busy}: {threads} threads share cores with them and may run several times slower than "
        f"{free} (OMP_WAIT_POLICY=PASSIVE set before torch loads keeps them fast, or "
        f"TORCHKILN_THREADS=load or OMP_NUM_THREADS={free} picks {free})"
    )


def _probe_thread_note(probe: ProbeResult | None, threads: int) -> str:
    """What the precision probe's 1-thread against `threads`-thread timing adds to the threads' reason."""
    if probe is not None and probe.under_load:
        # its 1-against-N timing measured the other processes as much as this machine (#41: a probe cached
        # while the test suite ran warned "OMP_NUM_THREADS=1" on the idle host ever after)
        return (
            f"; the precision probe ({probe.measured_at}) ran while other processes kept "
            f"{probe.others_cpus:.1f} CPUs busy: its thread timings are not used, and the next start "
            "on a quiet host measures again"
        )
    one = probe.one_thread_speedup if probe is not None and probe.threads == threads else None
    if one is not None and one >= MARGIN:
        return (
            f"; WARNING: the precision probe ({probe.measured_at}) ran its steps {one:.2f}x as fast on 1 "
            f"thread as on {threads}: OMP_NUM_THREADS=1 is likely faster here (shared CPUs, or steps too "
            "small to split: `python -m core.device --reprobe` measures again)"
        )
    return ""


def _exported_env(
    facts: DeviceFacts, matmul: str, mps_fallback: bool, device: torch.device, threads: int | None
) -> tuple[dict[str, str], str]:
    """(env, why): the variables `DevicePlan.apply()` exports, those the user set left out; `threads`: the
    chosen thread count (None: the user's OMP_NUM_THREADS stands)."""
    user = facts.user_env
    env: dict[str, str] = {}
    notes: list[str] = []
    if facts.cpu.graviton:
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        # AWS Graviton PyTorch guidance: cache oneDNN primitives across shapes, back big tensors with THP
        env["LRU_CACHE_CAPACITY"] = "1024"
        env["THP_MEM_ALLOC_ENABLE"] = "1"
        notes.append(
            "Graviton tuning per AWS guidance (torch reads THP_MEM_ALLOC_ENABLE at its first allocation: "
            "export the lines of `python -m core.device --env` before launching for it to apply)"
        )
    if matmul == "bf16" and device.type == "cpu" and not facts.mkldnn_fp32_precision_api:
        env["DNNL_DEFAULT_FPMATH_MODE"] = "BF16"
    if mps_fallback:
        env["PYTORCH_ENABLE_MPS_FALLBACK"] = "1"
    for key in [k for k in env if k in user]:
        notes.append(f"{key}={user[key]} kept from the user's environment")
        del env[key]
    return env, "; ".join(notes) or "nothing to export on this device"


def plan_for(
    facts: DeviceFacts,
    spec: str = "auto",
    precision: str = "auto",
    mps_fallback: bool = False,
    probe: ProbeResult | None = None,
    unmeasured: str = "not measured",
) -> DevicePlan:
    """Decide every device setting from `facts`, the user's overrides and, on CPUs, the measured `probe`
    (pure: no hardware access); `unmeasured` says why there is no probe, for the reasons."""
    device, det_device, why_device = _pick_device(facts, spec)
    precision = precision.strip().lower()
    if precision not in PRECISIONS:
        raise unknown_choice("precision", precision, PRECISIONS)
    probe = probe if device.type == "cpu" else None
    chosen, why_precision, det_precision = _chosen_precision(facts, device, precision, probe, unmeasured)
    dtype = _DTYPES[chosen]
    scaler = dtype is torch.float16
    matmul, why_matmul, det_matmul = _matmul_mode(facts, device, precision, probe)
    fallback, why_fallback, user_fallback = _mps_fallback(facts, device, mps_fallback)
    threads, env, why_threads, why_env, det_threads = _threads_and_env(
        facts, matmul, fallback and not user_fallback, device, probe
    )
    workers, why_workers = _loader_workers(facts, device)
    pin = device.type == "cuda"
    optimizer, why_opt = _adamw_impl(facts, device)
    attention, why_attention = _attention(facts, device)
    compile_backend, why_compile, det_compile = _compile(facts, device)
    allocator, why_allocator = heap_policy(facts, device)
    reasons = {
        "device": why_device,
        "precision": why_precision,
        "grad_scaler": "fp16 gradients underflow without loss scaling"
        if scaler
        else "no fp16: no loss scaling",
        "param_dtype": "mixed precision keeps fp32 master weights; autocast casts per op",
        "matmul": why_matmul,
        "threads": why_threads,
        "env": why_env,
        "data_loading": why_workers,
        "optimizer": why_opt,
        "attention": why_attention,
        "compile": why_compile,
        "mps_fallback": why_fallback,
        "allocator": why_allocator,
    }
    detected = _detected_column(facts, det_device, det_precision, det_matmul, det_threads, det_compile)
    return DevicePlan(
        device=device,
        autocast_dtype=dtype,
        grad_scaler=scaler,
        pin_memory=pin,
        num_workers=workers,
        optimizer_impl=optimizer,
        reasons=reasons,
        param_dtype=torch.float32,
        matmul_fp32_precision=matmul,
        num_threads=threads,
        env=env,
        attention_backends=attention,
        compile_backend=compile_backend,
        mps_fallback=fallback,
        non_blocking=pin,
        facts=facts,
        detected=detected,
        probe=probe,
        allocator=allocator,
    )


def _chosen_precision(
    facts: DeviceFacts, device: torch.device, precision: str, probe: ProbeResult | None, unmeasured: str
) -> tuple[str, str, str]:
    """(chosen precision, why, detected): the auto choice, or the one asked if `device` has it."""
    avail, auto, why_auto, detected = _precisions(facts, device, probe, unmeasured)
    if precision == "auto":
        return auto, f"auto: {why_auto}", detected
    if precision not in avail:
        raise ConfigError(
            f"precision={precision} is not available on {device} ({detected}); available: {', '.join(avail)}",
            key="precision",
            value=precision,
            valid=avail,
        )
    why = f"precision={precision} asked"
    if device.type == "cpu" and precision == "bf16" and probe is not None:
        why += f" (measured here at {probe.describe('bf16')})"
    return precision, why, detected


def _mps_fallback(facts: DeviceFacts, device: torch.device, opted_in: bool) -> tuple[bool, str, bool]:
    """(fallback, why, set by the user): whether ops MPS lacks run on the CPU."""
    user_fallback = facts.user_env.get("PYTORCH_ENABLE_MPS_FALLBACK") == "1"
    if device.type != "mps":
        return False, "only applies to MPS", user_fallback
    if user_fallback:
        why = "PYTORCH_ENABLE_MPS_FALLBACK=1 set by the user: unsupported ops run on CPU"
        return True, why, user_fallback
    if opted_in:
        why = "opted in: ops MPS lacks run on the CPU (slow, but the run continues)"
        return True, why, user_fallback
    return False, "off unless opted in (mps_fallback=true): an op MPS lacks fails loudly", user_fallback


def _loader_workers(facts: DeviceFacts, device: torch.device) -> tuple[int, str]:
    """(data loader workers, why, pin_memory's reason included)."""
    cores = max(1, facts.cpu.physical_cores // facts.local_world_size)
    if device.type == "cpu":
        # workers compete with the training threads for the same cores; only many-core hosts can spare some
        workers, why = min(2, cores // 8), "CPU training: loader workers would steal compute cores"
    else:
        workers, why = min(8, max(0, cores - 1)), "accelerator: one worker per spare core (max 8)"
    return workers, why + "; pin_memory only on CUDA (page-locked host buffers for async copies)"


def _adamw_impl(facts: DeviceFacts, device: torch.device) -> tuple[str, str]:
    """(AdamW implementation, why): fused, foreach or default, the fastest this torch has for `device`."""
    if device.type in facts.fused_adamw_devices:
        return "fused", f"torch {facts.torch_version} has a fused AdamW kernel for {device.type}"
    if device.type in facts.foreach_devices:
        return "foreach", f"no fused AdamW for {device.type} in this torch; foreach batches the update"
    return "default", f"no fused or foreach AdamW kernels for {device.type} in this torch"


def _detected_column(
    facts: DeviceFacts, device: str, precision: str, matmul: str, threads: str, compile_backend: str
) -> dict[str, str]:
    """The table's detected column: what each decision rests on (the rest read straight from `facts`)."""
    return {
        "device": device,
        "precision": precision,
        "matmul": matmul,
        "threads": threads,
        "data_loading": threads.split(",")[0],
        "optimizer": f"fused AdamW devices: {', '.join(sorted(facts.fused_adamw_devices))}",
        "attention": f"triton installed: {'yes' if facts.triton else 'no'}",
        "compile": compile_backend,
        "allocator": f"glibc {facts.glibc}" if facts.glibc else "not glibc",
    }


def _attention(facts: DeviceFacts, device: torch.device) -> tuple[tuple[str, ...], str]:
    if device.type == "cuda":
        cap = facts.cuda[device.index or 0].capability
        if facts.triton and cap >= (8, 0):
            # plain input goes to SDPA whatever this order says (core.attention.dispatch); the order is for
            # masked input, where the Triton kernels ran about 2x the blockwise SDPA path on padded batches
            # (BENCHMARKS.md § Attention)
            why = (
                "SDPA's flash/cuDNN/efficient kernels for plain input; Triton for packed/window/ALiBi/padding"
            )
            return ("triton", "sdpa", "math"), why
        lacking = "triton is not installed" if not facts.triton else "Triton kernels target sm80+"
        return ("sdpa", "math"), f"SDPA's CUDA kernels; {lacking}"
    if device.type == "mps":
        return ("sdpa", "math"), "SDPA's Metal kernels; Triton has no macOS support"
    return ("sdpa", "math"), "SDPA's CPU flash kernel; Triton runs on CPU only in its interpreter"


def _compile(facts: DeviceFacts, device: torch.device) -> tuple[str | None, str, str]:
    if device.type == "cuda":
        if facts.triton:
            return "inductor", "Inductor generates Triton kernels for CUDA", "triton installed"
        return None, "eager: Inductor needs triton for CUDA and it is not installed", "triton missing"
    if device.type == "mps":
        if facts.inductor_mps:
            return (
                "inductor",
                "this torch's Inductor has a Metal (MPS) backend",
                "torch._inductor.codegen.mps present",
            )
        return None, "eager: this torch's Inductor has no MPS backend", "torch._inductor.codegen.mps missing"
    if facts.cxx_compiler:
        return (
            "inductor",
            "Inductor generates C++/OpenMP kernels for CPU",
            f"C++ compiler: {facts.cxx_compiler}",
        )
    return (
        None,
        "eager: Inductor's CPU backend needs a C++ compiler (g++/clang++) and none is on PATH",
        "none",
    )


def resolve(
    spec: str = "auto",
    precision: str = "auto",
    mps_fallback: bool = False,
    facts: DeviceFacts | None = None,
    measure: bool = True,
    reprobe: bool = False,
) -> DevicePlan:
    """Pick the device (CUDA, then MPS, then CPU unless `spec` names one) and every setting that follows.

    On a CPU whose precision is left to the plan (`auto`, or Graviton3+ fast math), the choice rests on a
    measurement of this machine (`core.device.probe`), cached after the first run; `measure=False` skips
    it (for callers that read no precision decision), `reprobe=True` measures again.
    """
    facts = detect() if facts is None else facts
    prior = plan_for(facts, spec, precision, mps_fallback)
    fast_math = prior.matmul_fp32_precision == "bf16" and facts.mkldnn_fp32_precision_api
    if not measure or prior.device.type != "cpu" or (precision != "auto" and not fast_math):
        return prior
    if facts.cpu.emulated:
        # under QEMU user mode the probe would time the emulator (hundreds of times slower, and not in this
        # CPU's proportions): the priors stand, with the reason
        why = "not measured: an emulated CPU (QEMU user mode), where a timing measures the emulator"
        return plan_for(facts, spec, precision, mps_fallback, unmeasured=why)
    try:
        # measured at the idle host's thread count: a loaded start must not re-measure or cache its figures
        idle = dataclasses.replace(facts, busy_cpus=None)
        threads = plan_for(idle, spec, precision, mps_fallback).num_threads
        # the load the command measured at its start (recipes.cli.omp_wait), so a cached probe taken under
        # load is re-checked without another look at the CPUs
        probe = measured(facts.cpu, threads, fast_math, reprobe=reprobe, busy_now=facts.busy_cpus)
    except ProbeError as err:
        return plan_for(facts, spec, precision, mps_fallback, unmeasured=str(err))
    return plan_for(facts, spec, precision, mps_fallback, probe=probe)
