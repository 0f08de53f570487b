"""Device facts: what this machine and the installed torch offer, detected once and injectable for tests.

This is the only module in torchkiln that asks torch which accelerators exist; everything else reads a
`DevicePlan` (see `core.device.plan`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform
import shutil
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.cpuload import usable_cpus

# Neoverse core part numbers from the `CPU part` line of /proc/cpuinfo (ARM implementer 0x41). AWS
# Graviton2..5 use these cores; other vendors' chips with the same core (e.g. Ampere Altra = N1) get the
# same tuning, which is what AWS's guidance targets: the core, not the brand.
NEOVERSE_PARTS: dict[str, tuple[int, str]] = {
    "0xd0c": (2, "Neoverse N1"),
    "0xd40": (3, "Neoverse V1"),
    "0xd4f": (4, "Neoverse V2"),
    "0xd84": (5, "Neoverse V3"),
}
ARM_IMPLEMENTERS = {"0x41": "ARM", "0x61": "Apple", "0xc0": "Ampere", "0x48": "HiSilicon", "0x51": "Qualcomm"}

# Linux arm64 AT_HWCAP / AT_HWCAP2 bits (arch/arm64/include/uapi/asm/hwcap.h), under the names the kernel's
# /proc/cpuinfo `Features` line gives them. The auxiliary vector is what the kernel (or QEMU user mode)
# hands this process; under QEMU /proc/cpuinfo is the x86 host's, so only the auxv tells the truth there.
AT_HWCAP, AT_HWCAP2 = 16, 26
HWCAP_BITS = {
    "fp": 0,
    "asimd": 1,
    # LSE atomics and the dot product: what a Neoverse N1 (Graviton2) has over older Cortex-A cores
    "atomics": 8,
    "fphp": 9,
    "asimdhp": 10,
    "cpuid": 11,
    "asimddp": 20,
    "sve": 22,
}
HWCAP2_BITS = {"sve2": 1, "svei8mm": 9, "svebf16": 12, "i8mm": 13, "bf16": 14}

# Environment variables the plan reads or sets; a value the user exported always wins over the plan's.
USER_ENV_KEYS = (
    "OMP_NUM_THREADS",
    "TORCHKILN_THREADS",
    "OMP_WAIT_POLICY",
    "LRU_CACHE_CAPACITY",
    "THP_MEM_ALLOC_ENABLE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "PYTORCH_ENABLE_MPS_FALLBACK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHKILN_ALLOCATOR",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)


@dataclass(frozen=True)
class CpuFacts:
    """The host CPU: architecture, vendor, feature flags and core counts (from /proc/cpuinfo on Linux)."""

    arch: str
    vendor: str
    model_name: str
    flags: frozenset[str] = frozenset()
    logical_cpus: int = 1
    physical_cores: int = 1
    part: str | None = None
    #: where `flags` came from: "auxv" (HWCAP/HWCAP2), "cpuinfo" or "none"
    flags_source: str = "cpuinfo"
    #: /proc/cpuinfo is another architecture's: a user-mode emulator (QEMU) runs this process, so a timing
    #: here measures the emulator, not this CPU
    emulated: bool = False

    @property
    def graviton(self) -> int | None:
        """Graviton generation of the Neoverse core (2..5); with no core part visible (QEMU, some VMs), the
        lowest generation whose features this aarch64 CPU has; None for other CPUs."""
        if self.arch != "aarch64":
            return None
        if self.part is not None:
            hit = NEOVERSE_PARTS.get(self.part)
            return hit[0] if hit else None
        return self.graviton_by_features

    @property
    def graviton_by_features(self) -> int | None:
        """3 for Arm BF16 + SVE (Neoverse V1 and later), 2 for dot product + LSE atomics (N1), else None."""
        if self.arch != "aarch64":
            return None
        if {"bf16", "sve"} <= self.flags:
            return 3
        if {"asimddp", "atomics"} <= self.flags:
            return 2
        return None

    @property
    def core_name(self) -> str | None:
        """Neoverse core name for a Graviton-class CPU."""
        hit = NEOVERSE_PARTS.get(self.part or "") if self.arch == "aarch64" else None
        return hit[1] if hit else None

    @property
    def sve(self) -> bool:
        """Arm Scalable Vector Extension."""
        return "sve" in self.flags

    @property
    def i8mm(self) -> bool:
        """Arm int8 matrix multiply instructions."""
        return "i8mm" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        """x86 AVX-512 BF16 dot-product instructions."""
        return "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """x86 AMX tiles with bf16 matmul."""
        return "amx_bf16" in self.flags and "amx_tile" in self.flags

    @property
    def bf16(self) -> bool:
        """Native bf16 arithmetic: Arm BF16 (Graviton3+) or x86 AVX-512-BF16 / AMX-BF16."""
        if self.arch == "aarch64":
            return "bf16" in self.flags
        return self.avx512_bf16 or self.amx_bf16

    @property
    def fp16(self) -> bool:
        """Native fp16 arithmetic: Arm FP16 SIMD or x86 AVX-512-FP16 / AMX-FP16."""
        if self.arch == "aarch64":
            return "asimdhp" in self.flags
        return "avx512_fp16" in self.flags or "amx_fp16" in self.flags

    def describe(self) -> str:
        """One line naming the CPU and the flags that decide precision."""
        name = self.model_name
        if self.graviton and self.core_name:
            name = f"{self.core_name} (Graviton{self.graviton} class)"
        elif self.graviton:
            name = f"{name} (Graviton{self.graviton}-class features)"
        wanted = (
            ("bf16", "sve", "i8mm") if self.arch == "aarch64" else ("avx512_bf16", "amx_bf16", "avx512_fp16")
        )
        shown = [f for f in wanted if f in self.flags]
        flags = ", ".join(shown) or "none of " + "/".join(wanted)
        emulated = " (emulated: /proc/cpuinfo is the host's)" if self.emulated else ""
        return f"{self.arch}{emulated} {self.vendor} {name}; flags ({self.flags_source}): {flags}"


@dataclass(frozen=True)
class CudaFacts:
    """One CUDA device."""

    index: int
    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        """'cuda:0 NVIDIA H100 (sm90)'."""
        return f"cuda:{self.index} {self.name} (sm{self.capability[0]}{self.capability[1]})"


@dataclass(frozen=True)
class DeviceFacts:
    """Everything the plan decides from: hardware, installed torch features and the user's environment."""

    cpu: CpuFacts
    cuda: tuple[CudaFacts, ...] = ()
    #: torch.backends.cpu.get_cpu_capability(): the CPU kernels torch picked (e.g. SVE256, AVX512, DEFAULT)
    cpu_capability: str | None = None
    mps_available: bool = False
    mps_bf16: bool = False
    mps_autocast: bool = True
    torch_version: str = torch.__version__
    triton: bool = False
    cxx_compiler: str | None = None
    inductor_mps: bool = False
    fused_adamw_devices: frozenset[str] = frozenset({"cuda"})
    foreach_devices: frozenset[str] = frozenset({"cuda"})
    cuda_fp32_precision_api: bool = True
    mkldnn_fp32_precision_api: bool = True
    user_env: Mapping[str, str] = field(default_factory=dict)
    #: 1-minute load average at detection (None where the OS has none); only ever used for a warning
    load_average: float | None = None
    #: CPUs that other processes kept busy over a short window at start, nice'd ones excluded, as the
    #: command layer measured it before torch loaded (TORCHKILN_BUSY_CPUS; None: not measured)
    busy_cpus: float | None = None
    #: the C library's version where it is glibc (platform.libc_ver), None elsewhere (musl, macOS, Windows)
    glibc: str | None = None

    @property
    def local_world_size(self) -> int:
        """Processes sharing this machine (torchrun's LOCAL_WORLD_SIZE), 1 when run directly."""
        return max(1, int(self.user_env.get("LOCAL_WORLD_SIZE", "1") or 1))

    @property
    def local_rank(self) -> int:
        """This process's rank on the machine (torchrun's LOCAL_RANK), 0 when run directly."""
        return int(self.user_env.get("LOCAL_RANK", "0") or 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready facts, with derived CPU properties spelled out."""
        out = asdict(self)
        out["cpu"]["flags"] = sorted(self.cpu.flags)
        out["cpu"].update(
            graviton=self.cpu.graviton,
            graviton_by_features=self.cpu.graviton_by_features,
            core_name=self.cpu.core_name,
            bf16=self.cpu.bf16,
            fp16=self.cpu.fp16,
            sve=self.cpu.sve,
            i8mm=self.cpu.i8mm,
            avx512_bf16=self.cpu.avx512_bf16,
            amx_bf16=self.cpu.amx_bf16,
        )
        out["fused_adamw_devices"] = sorted(self.fused_adamw_devices)
        out["foreach_devices"] = sorted(self.foreach_devices)
        out["user_env"] = dict(self.user_env)
        return out


def _first_block(cpuinfo_text: str) -> dict[str, str]:
    """Key/value pairs of the first processor block of /proc/cpuinfo."""
    block: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            if block:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            block.setdefault(key.strip(), value.strip())
    return block


def hwcap_flags(hwcap: int, hwcap2: int) -> frozenset[str]:
    """The Arm feature names set in AT_HWCAP / AT_HWCAP2 values."""
    return frozenset(
        [name for name, bit in HWCAP_BITS.items() if hwcap >> bit & 1]
        + [name for name, bit in HWCAP2_BITS.items() if hwcap2 >> bit & 1]
    )


def parse_auxv(data: bytes) -> dict[int, int]:
    """(type -> value) pairs of a /proc/self/auxv image: native unsigned longs, ended by AT_NULL."""
    size = struct.calcsize("@LL")
    out: dict[int, int] = {}
    for key, value in struct.iter_unpack("@LL", data[: len(data) - len(data) % size]):
        if key == 0:  # AT_NULL
            break
        out[key] = value
    return out


def read_hwcaps() -> tuple[int, int] | None:
    """This process's (AT_HWCAP, AT_HWCAP2): getauxval, else /proc/self/auxv; None where neither answers."""
    getauxval = getattr(os, "getauxval", None)  # not in CPython up to 3.13: glibc's through ctypes then
    if getauxval is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            getauxval = libc.getauxval
            getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
        except (OSError, AttributeError):  # musl without getauxval, or no libc to load
            getauxval = None
    if getauxval is not None:
        hwcap = getauxval(AT_HWCAP)
        if hwcap:
            return hwcap, getauxval(AT_HWCAP2)
    try:
        with open("/proc/self/auxv", "rb") as f:
            auxv = parse_auxv(f.read())
    except OSError:
        return None
    return (auxv[AT_HWCAP], auxv.get(AT_HWCAP2, 0)) if AT_HWCAP in auxv else None


def _read_midr() -> str:
    """The MIDR_EL1 of cpu0 as sysfs gives it on arm64 Linux (hex), '' where it is absent."""
    try:
        return Path("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1").read_text().strip()
    except (OSError, ValueError):
        return ""


def _midr_fields(midr: str) -> tuple[str, str] | None:
    """(implementer, part) as /proc/cpuinfo writes them ('0x41', '0xd40') from a MIDR_EL1 hex value."""
    try:
        value = int(midr, 16)
    except ValueError:
        return None
    return f"0x{value >> 24 & 0xFF:02x}", f"0x{value >> 4 & 0xFFF:03x}"


def detect_cpu(
    cpuinfo_text: str,
    *,
    arch: str | None = None,
    logical_cpus: int | None = None,
    system: str | None = None,
    hwcaps: tuple[int, int] | None = None,
    midr: str = "",
) -> CpuFacts:
    """`CpuFacts` from /proc/cpuinfo text (x86 or Arm format) and, on aarch64, the auxv's HWCAP/HWCAP2
    (`hwcaps`, preferred for flags) and sysfs's MIDR_EL1 (`midr`); empty text gives a generic CPU.

    An aarch64 process handed x86-format cpuinfo (QEMU user mode passes the host's through) reads nothing
    from it: neither its flags nor its model name describe the CPU this process runs on."""
    info = _first_block(cpuinfo_text)
    emulated = False
    if arch is None:
        if "vendor_id" in info:
            arch = "x86_64"
        elif "CPU implementer" in info:
            arch = "aarch64"
        else:
            arch = platform.machine() or "unknown"
    arch = {"arm64": "aarch64", "AMD64": "x86_64", "amd64": "x86_64"}.get(arch, arch)
    processors = sum(1 for line in cpuinfo_text.splitlines() if line.split(":")[0].strip() == "processor")
    logical = logical_cpus or processors or os.cpu_count() or 1
    if arch == "aarch64":
        if "vendor_id" in info or "flags" in info:
            info, emulated = {}, True  # x86 cpuinfo (an emulator's host): nothing in it is about this CPU
        if hwcaps is not None:
            flags, source = hwcap_flags(*hwcaps), "auxv"
        else:
            flags = frozenset(info.get("Features", "").split())
            source = "cpuinfo" if flags else "none"
        if "CPU implementer" not in info and _midr_fields(midr):
            info["CPU implementer"], info["CPU part"] = _midr_fields(midr)
        implementer = info.get("CPU implementer", "").lower()
        vendor = ARM_IMPLEMENTERS.get(implementer, implementer or "unknown")
        if not implementer and (system or platform.system()) == "Darwin":
            vendor = "Apple"
        part = info.get("CPU part", "").lower() or None
        model_name = info.get("model name") or (f"part {part}" if part else "Arm CPU")
        physical = logical  # Neoverse and Apple cores have no SMT
    else:
        source = "cpuinfo"
        flags = frozenset(info.get("flags", "").split())
        vendor = info.get("vendor_id", "unknown")
        part = None
        model_name = info.get("model name", "unknown CPU")
        # siblings / cpu cores = hardware threads per core; the `ht` flag alone is set even in VMs without SMT
        siblings, cores = int(info.get("siblings", 0) or 0), int(info.get("cpu cores", 0) or 0)
        per_core = max(1, siblings // cores) if siblings and cores else 1
        physical = max(1, logical // per_core)
    return CpuFacts(arch, vendor, model_name, flags, logical, physical, part, source, emulated)


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # macOS, Windows: no procfs
        return ""


def _mps_bf16() -> bool:
    # Asking MPS for a bf16 tensor is the ground truth: it needs macOS 14+ and a torch that implements it.
    try:
        torch.zeros(1, dtype=torch.bfloat16, device="mps")
    except (RuntimeError, TypeError):
        return False
    return True


def _fused_adamw_devices() -> frozenset[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return frozenset(_get_fused_kernels_supported_devices())
    except ImportError:  # torch < 2.2 had fused AdamW on CUDA only
        return frozenset({"cuda"})


def _foreach_devices() -> frozenset[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return frozenset(_get_foreach_kernels_supported_devices())
    except ImportError:
        return frozenset({"cuda"})


def _cpu_capability() -> str | None:
    # the kernel family torch dispatches to here (AVX2, AVX512, SVE256, DEFAULT...): torch's own CPU probe
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):  # torch < 2.1
        return None


def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def detect(env: Mapping[str, str] | None = None) -> DeviceFacts:
    """Detect the live machine's facts (initialises CUDA when present)."""
    env = os.environ if env is None else env
    cuda: tuple[CudaFacts, ...] = ()
    if torch.cuda.is_available():
        cuda = tuple(
            CudaFacts(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())
        )
    mps = torch.backends.mps.is_available()
    machine = {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
    aarch64_linux = machine == "aarch64" and platform.system() == "Linux"
    return DeviceFacts(
        cpu=detect_cpu(
            _read_cpuinfo(),
            arch=machine,
            logical_cpus=usable_cpus(),
            hwcaps=read_hwcaps() if aarch64_linux else None,
            midr=_read_midr() if aarch64_linux else "",
        ),
        cpu_capability=_cpu_capability(),
        cuda=cuda,
        mps_available=mps,
        mps_bf16=mps and _mps_bf16(),
        # torch.autocast("mps") arrived in torch 2.5, together with is_autocast_available
        mps_autocast=hasattr(torch.amp, "is_autocast_available") and torch.amp.is_autocast_available("mps"),
        torch_version=torch.__version__,
        triton=importlib.util.find_spec("triton") is not None,
        cxx_compiler=_cxx_compiler(),
        # a file check, not an import: importing Inductor costs seconds and is not needed to plan
        inductor_mps=(Path(torch.__file__).parent / "_inductor" / "codegen" / "mps.py").is_file(),
        fused_adamw_devices=_fused_adamw_devices(),
        foreach_devices=_foreach_devices(),
        cuda_fp32_precision_api=hasattr(torch.backends.cuda.matmul, "fp32_precision"),
        mkldnn_fp32_precision_api=hasattr(torch.backends.mkldnn, "matmul"),
        user_env={k: env[k] for k in USER_ENV_KEYS if k in env},
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        busy_cpus=_busy_cpus(env.get("TORCHKILN_BUSY_CPUS")),
        glibc=_glibc(),
    )


def _glibc() -> str | None:
    """glibc's version where the process runs on it, else None."""
    lib, version = platform.libc_ver()
    return version if lib == "glibc" and version else None


def _busy_cpus(value: str | None) -> float | None:
    """The busy-CPU count the launching command measured before torch loaded (TORCHKILN_BUSY_CPUS), if any."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
