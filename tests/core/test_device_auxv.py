"""core.device on aarch64: CPU features from the auxiliary vector (HWCAP/HWCAP2) with fake values, the x86
cpuinfo an emulator passes through, and (under `make test-arm64`) the live facts and plan of a real aarch64
process on the emulated CPU."""

from __future__ import annotations

import platform
import struct
from pathlib import Path

import pytest
import torch

import core.device.facts as facts_mod
import core.device.plan as plan_mod
from core.device import DeviceFacts, detect, detect_cpu, plan_for, resolve
from core.device.facts import (
    AT_HWCAP,
    AT_HWCAP2,
    HWCAP2_BITS,
    HWCAP_BITS,
    hwcap_flags,
    parse_auxv,
    read_hwcaps,
)
from core.device.probe import CASES, ProbeResult

pytestmark = pytest.mark.arm64

FIXTURES = Path(__file__).parent / "fixtures"
LIVE_AARCH64 = platform.machine() in ("aarch64", "arm64") and platform.system() == "Linux"


def hwcaps(*names: str) -> tuple[int, int]:
    """(AT_HWCAP, AT_HWCAP2) values with exactly the named features set."""
    hwcap = sum(1 << HWCAP_BITS[n] for n in names if n in HWCAP_BITS)
    hwcap2 = sum(1 << HWCAP2_BITS[n] for n in names if n in HWCAP2_BITS)
    return hwcap, hwcap2


#: what Linux (and QEMU user mode) report for the two emulated CPUs of `make test-arm64`
NEOVERSE_N1 = hwcaps("fp", "asimd", "atomics", "fphp", "asimdhp", "cpuid", "asimddp")
GRAVITON3_LIKE = hwcaps(*("fp", "asimd", "atomics", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm"))
X86_CPUINFO = (FIXTURES / "cpuinfo_x86_zen4.txt").read_text()


def probe(bf16: float, fast_math: float | None = None) -> ProbeResult:
    """A measurement where bf16 (fast math) ran `bf16` (`fast_math`) times as fast as fp32."""
    ms = {"fp32": dict.fromkeys(CASES, 10.0), "bf16": dict.fromkeys(CASES, 10.0 / bf16)}
    if fast_math is not None:
        ms["fast_math"] = dict.fromkeys(CASES, 10.0 / fast_math)
    return ProbeResult("test", 2, ms, {}, 1.0, torch.__version__, "2026-12-01T00:00:00Z")


def test_hwcap_bits_match_the_kernel_header():
    # arch/arm64/include/uapi/asm/hwcap.h
    assert (HWCAP_BITS["asimd"], HWCAP_BITS["asimdhp"], HWCAP_BITS["sve"]) == (1, 10, 22)
    assert (HWCAP2_BITS["sve2"], HWCAP2_BITS["i8mm"], HWCAP2_BITS["bf16"]) == (1, 13, 14)
    assert hwcap_flags(1 << 22 | 1 << 1, 1 << 14 | 1 << 13) == {"sve", "asimd", "bf16", "i8mm"}
    assert hwcap_flags(0, 0) == frozenset()
    # bits this module does not name are ignored, not misread
    assert hwcap_flags(1 << 40 | 1 << 2, 1 << 30) == frozenset()


def test_parse_auxv_reads_pairs_until_at_null():
    pairs = [(6, 4096), (AT_HWCAP, 0b11), (AT_HWCAP2, 1 << 14), (0, 0), (AT_HWCAP, 99)]
    data = b"".join(struct.pack("@LL", k, v) for k, v in pairs) + b"\x01\x02"  # a torn tail is dropped
    assert parse_auxv(data) == {6: 4096, AT_HWCAP: 0b11, AT_HWCAP2: 1 << 14}
    assert parse_auxv(b"") == {}


@pytest.mark.parametrize(
    ("caps", "gen", "bf16", "sve", "i8mm"),
    [(NEOVERSE_N1, 2, False, False, False), (GRAVITON3_LIKE, 3, True, True, True)],
    ids=["neoverse-n1", "graviton3-like"],
)
def test_auxv_flags_win_over_the_emulators_x86_cpuinfo(caps, gen, bf16, sve, i8mm):
    # QEMU user mode: an aarch64 process reading the x86 host's /proc/cpuinfo
    cpu = detect_cpu(X86_CPUINFO, arch="aarch64", logical_cpus=2, hwcaps=caps)
    assert (cpu.arch, cpu.flags_source, cpu.part) == ("aarch64", "auxv", None)
    assert (cpu.bf16, cpu.sve, cpu.i8mm) == (bf16, sve, i8mm)
    assert not cpu.flags & {"avx2", "avx512_bf16", "avx512f"}  # nothing of the x86 host
    assert "EPYC" not in cpu.model_name and cpu.vendor != "AuthenticAMD"
    assert cpu.graviton == cpu.graviton_by_features == gen
    assert cpu.logical_cpus == cpu.physical_cores == 2
    assert cpu.emulated  # and so its timings would be the emulator's


def test_an_emulated_cpu_keeps_the_priors_and_runs_no_probe(monkeypatch):
    cpu = detect_cpu(X86_CPUINFO, arch="aarch64", logical_cpus=2, hwcaps=GRAVITON3_LIKE)
    facts = DeviceFacts(cpu=cpu, fused_adamw_devices=frozenset({"cpu"}), cxx_compiler="g++")

    def no_probe(*args: object, **kwargs: object) -> ProbeResult:
        raise AssertionError("the probe ran on an emulated CPU")

    monkeypatch.setattr(plan_mod, "measured", no_probe)
    plan = resolve(facts=facts)
    # Graviton3+ priors (AWS guidance): bf16 autocast and oneDNN bf16 fast math, unmeasured
    assert plan.probe is None and (plan.precision, plan.matmul_fp32_precision) == ("bf16", "bf16")
    assert not detect_cpu((FIXTURES / "cpuinfo_graviton3.txt").read_text()).emulated


def test_x86_cpuinfo_without_auxv_gives_no_flags_not_x86_ones():
    cpu = detect_cpu(X86_CPUINFO, arch="aarch64", logical_cpus=2)
    assert cpu.flags == frozenset() and cpu.flags_source == "none"
    assert cpu.graviton is None and not cpu.bf16 and not cpu.fp16


def test_arm_cpuinfo_stays_the_fallback_and_its_part_names_the_core():
    text = (FIXTURES / "cpuinfo_graviton3.txt").read_text()
    from_cpuinfo = detect_cpu(text)
    assert from_cpuinfo.flags_source == "cpuinfo" and from_cpuinfo.bf16 and from_cpuinfo.graviton == 3
    # with the auxv as well: its flags, the cpuinfo's core part
    both = detect_cpu(text, hwcaps=NEOVERSE_N1)
    assert both.flags_source == "auxv" and not both.bf16 and both.core_name == "Neoverse V1"


def test_midr_from_sysfs_names_the_core_when_cpuinfo_does_not():
    cpu = detect_cpu("", arch="aarch64", logical_cpus=4, hwcaps=NEOVERSE_N1, midr="0x00000000413fd0c1")
    assert (cpu.vendor, cpu.part, cpu.graviton, cpu.core_name) == ("ARM", "0xd0c", 2, "Neoverse N1")
    # a core that is no Neoverse keeps no Graviton tuning, whatever its features
    apple = detect_cpu("", arch="aarch64", hwcaps=GRAVITON3_LIKE, midr="0x00000000611f0320")
    assert apple.vendor == "Apple" and apple.graviton is None


def test_older_arm_cores_get_no_graviton_class():
    cortex_a72 = detect_cpu("", arch="aarch64", hwcaps=hwcaps("fp", "asimd", "cpuid"))
    assert cortex_a72.graviton is None


@pytest.mark.parametrize(
    ("caps", "matmul"),
    [(NEOVERSE_N1, "ieee"), (GRAVITON3_LIKE, "bf16")],
    ids=["neoverse-n1", "graviton3-like"],
)
def test_graviton_plan_from_auxv_features(caps, matmul):
    cpu = detect_cpu(X86_CPUINFO, arch="aarch64", logical_cpus=4, hwcaps=caps)
    facts = DeviceFacts(cpu=cpu, fused_adamw_devices=frozenset({"cpu"}), cxx_compiler="g++")
    plan = plan_for(facts, probe=probe(bf16=1.3, fast_math=1.3))
    # autocast follows the measurement on both; fast math needs the Arm BF16 instructions as well
    assert (plan.matmul_fp32_precision, plan.precision, plan.num_threads) == (matmul, "bf16", 4)
    assert plan.env == {"OMP_NUM_THREADS": "4", "LRU_CACHE_CAPACITY": "1024", "THP_MEM_ALLOC_ENABLE": "1"}
    # a measurement that says bf16 does not pay keeps fp32 on both
    slow = plan_for(facts, probe=probe(bf16=0.5, fast_math=0.5))
    assert (slow.matmul_fp32_precision, slow.precision) == ("ieee", "fp32")


def test_read_hwcaps_answers_on_aarch64_linux_only_there_is_asked():
    caps = read_hwcaps()
    if LIVE_AARCH64:
        assert caps is not None and "asimd" in hwcap_flags(*caps)
    else:
        # an x86 process has an AT_HWCAP too (other bits); detect() never asks for it there
        assert detect().cpu.flags_source == "cpuinfo"


# ---------------------------------------------------------------- a real aarch64 process (make test-arm64)

live = pytest.mark.skipif(not LIVE_AARCH64, reason="needs an aarch64 Linux process (make test-arm64)")


@live
def test_live_facts_come_from_the_auxv_and_agree_with_torch():
    facts = detect()
    cpu = facts.cpu
    assert (cpu.arch, cpu.flags_source) == ("aarch64", "auxv") and "asimd" in cpu.flags
    assert not cpu.flags & {"avx2", "avx512f", "sse4_2"}
    # torch's own probe of the same CPU: SVE kernels exactly where the auxv says SVE
    assert facts.cpu_capability is not None
    assert facts.cpu_capability.startswith("SVE") == cpu.sve
    assert torch.backends.mkldnn.is_available()


@live
def test_live_plan_is_the_graviton_plan(monkeypatch):
    for key in facts_mod.USER_ENV_KEYS:  # apply() exports into os.environ: undone after the test
        monkeypatch.delenv(key, raising=False)
    threads, mode = torch.get_num_threads(), torch.backends.mkldnn.matmul.fp32_precision
    facts = detect(env={})
    plan = plan_for(facts, probe=probe(bf16=1.3, fast_math=1.3))
    assert facts.cpu.graviton in (2, 3, 4, 5)
    assert plan.env["LRU_CACHE_CAPACITY"] == "1024" and plan.env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert plan.num_threads == facts.cpu.physical_cores
    assert plan.matmul_fp32_precision == ("bf16" if facts.cpu.bf16 else "ieee")
    live_plan = resolve()  # what `python -m core.device` prints here
    assert live_plan.env == plan.env
    if facts.cpu.emulated:  # no probe under the emulator: the Graviton priors (AWS guidance)
        assert live_plan.probe is None
        want_precision = ("bf16", "bf16") if facts.cpu.bf16 else ("fp32", "ieee")
        assert (live_plan.precision, live_plan.matmul_fp32_precision) == want_precision
    try:
        plan.apply()
        want = "bf16" if facts.cpu.bf16 else "none"
        assert torch.backends.mkldnn.matmul.fp32_precision == want
        assert torch.get_num_threads() == plan.num_threads
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = mode
