"""core.device: detection from real-format /proc/cpuinfo, plans for simulated CUDA/MPS/Graviton/x86 hosts,
runtime settings applied in a subprocess, the CLI, and the rule that only core/device asks for devices."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import core.device.facts as facts_mod
import core.device.plan as plan_mod
from core.device import CudaFacts, DeviceFacts, detect, detect_cpu, plan_for, resolve
from core.device.__main__ import main as cli_main
from core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"


def cpuinfo(name: str) -> str:
    return (FIXTURES / f"cpuinfo_{name}.txt").read_text()


def host(cpu: str = "x86_avx2", **kw) -> DeviceFacts:
    """Simulated facts: a fixture CPU plus whatever accelerators/torch features the test names."""
    kw.setdefault("fused_adamw_devices", frozenset({"cuda", "cpu", "mps"}))
    kw.setdefault("triton", True)
    kw.setdefault("cxx_compiler", "g++")
    return DeviceFacts(cpu=detect_cpu(cpuinfo(cpu)), **kw)


def gpu(major: int, minor: int, n: int = 1) -> tuple[CudaFacts, ...]:
    return tuple(CudaFacts(i, f"GPU sm{major}{minor}", (major, minor)) for i in range(n))


# ---------------------------------------------------------------- CPU detection from /proc/cpuinfo


@pytest.mark.parametrize(
    "name, gen, core, bf16, sve, i8mm, logical",
    [
        ("graviton2", 2, "Neoverse N1", False, False, False, 4),
        ("graviton3", 3, "Neoverse V1", True, True, True, 8),
        ("graviton4", 4, "Neoverse V2", True, True, True, 4),
    ],
)
def test_detect_graviton(name, gen, core, bf16, sve, i8mm, logical):
    cpu = detect_cpu(cpuinfo(name))
    assert (cpu.arch, cpu.vendor) == ("aarch64", "ARM")
    assert (cpu.graviton, cpu.core_name) == (gen, core)
    assert (cpu.bf16, cpu.sve, cpu.i8mm) == (bf16, sve, i8mm)
    assert cpu.logical_cpus == cpu.physical_cores == logical  # Neoverse: no SMT
    assert not cpu.avx512_bf16 and not cpu.amx_bf16
    assert ("sve2" in cpu.flags) == (gen == 4)


def test_detect_x86_amx_host():
    cpu = detect_cpu(cpuinfo("x86_amx"))
    assert (cpu.arch, cpu.vendor, cpu.graviton) == ("x86_64", "GenuineIntel", None)
    assert cpu.amx_bf16 and cpu.avx512_bf16 and cpu.bf16 and cpu.fp16
    assert (cpu.logical_cpus, cpu.physical_cores) == (4, 2)  # siblings 4 / cpu cores 2 = 2-way SMT
    assert "amx_bf16" in cpu.describe()


def test_detect_x86_without_bf16():
    cpu = detect_cpu(cpuinfo("x86_avx2"))
    assert (cpu.vendor, cpu.bf16, cpu.fp16, cpu.amx_bf16) == ("AuthenticAMD", False, False, False)
    assert (cpu.logical_cpus, cpu.physical_cores) == (2, 1)


def test_detect_cpu_honours_affinity_count_and_empty_text():
    assert detect_cpu(cpuinfo("x86_amx"), logical_cpus=2).physical_cores == 1  # 2 usable threads of 1 core
    generic = detect_cpu("", arch="arm64", system="Darwin")  # macOS: no procfs
    assert (generic.arch, generic.vendor, generic.bf16, generic.graviton) == ("aarch64", "Apple", False, None)


# ---------------------------------------------------------------- plans for simulated hosts


@pytest.mark.parametrize("cpu, fast_math", [("graviton3", "bf16"), ("graviton4", "bf16")])
def test_graviton3_plus_plan(cpu, fast_math):
    plan = plan_for(host(cpu))
    assert plan.device == torch.device("cpu")
    assert plan.autocast_dtype is torch.bfloat16 and not plan.grad_scaler
    assert plan.matmul_fp32_precision == fast_math
    assert plan.env == {
        "OMP_NUM_THREADS": str(plan.num_threads),
        "LRU_CACHE_CAPACITY": "1024",
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    assert "Arm BF16" in plan.reasons["precision"] and "AWS" in plan.reasons["matmul"]
    assert plan.optimizer_impl == "fused" and plan.compile_backend == "inductor"
    assert plan.attention_backends == ("sdpa", "math") and not plan.pin_memory


def test_graviton2_plan_stays_fp32_with_tuning():
    plan = plan_for(host("graviton2"))
    assert plan.autocast_dtype is None and plan.matmul_fp32_precision == "ieee"
    assert "Graviton3+" in plan.reasons["matmul"]
    assert plan.env["LRU_CACHE_CAPACITY"] == "1024" and plan.env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert plan.num_threads == 4


def test_graviton_threads_split_across_local_processes_and_user_env_wins():
    plan = plan_for(host("graviton3", user_env={"LOCAL_WORLD_SIZE": "2"}))
    assert plan.num_threads == 4 and plan.env["OMP_NUM_THREADS"] == "4"  # 8 cores / 2 processes
    plan = plan_for(host("graviton3", user_env={"OMP_NUM_THREADS": "3", "LRU_CACHE_CAPACITY": "64"}))
    assert (
        plan.num_threads == 3 and "OMP_NUM_THREADS" not in plan.env and "LRU_CACHE_CAPACITY" not in plan.env
    )
    assert (
        "set by the user" in plan.reasons["threads"] and "LRU_CACHE_CAPACITY=64 kept" in plan.reasons["env"]
    )


def test_graviton3_on_torch_without_mkldnn_precision_api_uses_env_var():
    plan = plan_for(host("graviton3", mkldnn_fp32_precision_api=False))
    assert plan.matmul_fp32_precision == "bf16" and plan.env["DNNL_DEFAULT_FPMATH_MODE"] == "BF16"
    assert "fp32" in plan_for(host("graviton3"), precision="fp32").reasons["matmul"]
    assert plan_for(host("graviton3"), precision="fp32").matmul_fp32_precision == "ieee"


def test_x86_plans():
    amx = plan_for(host("x86_amx"))
    assert amx.autocast_dtype is torch.bfloat16 and "AMX-BF16" in amx.reasons["precision"]
    assert amx.env == {} and amx.matmul_fp32_precision == "ieee" and amx.num_threads == 2
    assert plan_for(host("x86_amx"), precision="fp16").grad_scaler  # AVX512-FP16: fp16 offered, with scaling
    plain = plan_for(host("x86_avx2"))
    assert plain.autocast_dtype is None and "no native bf16" in plain.reasons["precision"]
    forced = plan_for(host("x86_avx2"), precision="bf16")
    assert forced.autocast_dtype is torch.bfloat16 and "emulated" in forced.reasons["precision"]
    with pytest.raises(
        ConfigError, match=r"^precision=fp16 is not available on cpu .*; available: fp32, bf16$"
    ):
        plan_for(host("x86_avx2"), precision="fp16")


def test_cuda_sm70_fp16_with_scaler():
    plan = plan_for(host(cuda=gpu(7, 0)))
    assert plan.device == torch.device("cuda", 0)
    assert plan.autocast_dtype is torch.float16 and plan.grad_scaler
    assert plan.matmul_fp32_precision == "ieee" and "Ampere" in plan.reasons["matmul"]
    assert plan.attention_backends == ("sdpa", "math") and "sm80" in plan.reasons["attention"]
    assert plan.pin_memory and plan.non_blocking and plan.optimizer_impl == "fused"
    with pytest.raises(
        ConfigError,
        match=r"^precision=bf16 is not available on cuda:0 \(GPU sm70 \(sm70\)\); available: fp32, fp16$",
    ):
        plan_for(host(cuda=gpu(7, 0)), precision="bf16")


@pytest.mark.parametrize("major", [8, 9])
def test_cuda_sm80_sm90_bf16_tf32(major):
    plan = plan_for(host(cuda=gpu(major, 0)))
    assert plan.autocast_dtype is torch.bfloat16 and not plan.grad_scaler
    assert plan.matmul_fp32_precision == "tf32"
    assert plan.attention_backends == ("sdpa", "triton", "math") and plan.compile_backend == "inductor"
    strict = plan_for(host(cuda=gpu(major, 0)), precision="fp32")
    assert strict.autocast_dtype is None and strict.matmul_fp32_precision == "ieee"
    half = plan_for(host(cuda=gpu(major, 0)), precision="fp16")
    assert half.autocast_dtype is torch.float16 and half.grad_scaler


def test_cuda_without_triton_is_eager_sdpa_only():
    plan = plan_for(host(cuda=gpu(9, 0), triton=False))
    assert plan.compile_backend is None and "triton" in plan.reasons["compile"]
    assert plan.attention_backends == ("sdpa", "math")


def test_cuda_index_and_local_rank():
    facts = host(cuda=gpu(8, 0, n=2), user_env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert plan_for(facts).device == torch.device("cuda", 1)
    assert plan_for(facts, "cuda:0").device == torch.device("cuda", 0)
    with pytest.raises(
        ConfigError, match=r"^device=cuda:2 is not available here; available: cpu, cuda, cuda:0, cuda:1$"
    ):
        plan_for(facts, "cuda:2")


def test_mps_plans_and_fallback_opt_in():
    with_bf16 = plan_for(host(mps_available=True, mps_bf16=True, inductor_mps=True))
    assert with_bf16.device == torch.device("mps") and with_bf16.autocast_dtype is torch.bfloat16
    assert with_bf16.compile_backend == "inductor" and not with_bf16.pin_memory
    assert not with_bf16.mps_fallback and "PYTORCH_ENABLE_MPS_FALLBACK" not in with_bf16.env
    old = plan_for(host(mps_available=True, mps_bf16=False, inductor_mps=False))
    assert old.autocast_dtype is None and "macOS" in old.reasons["precision"]
    assert old.compile_backend is None and "MPS backend" in old.reasons["compile"]
    with pytest.raises(ConfigError, match="available: fp32, fp16"):
        plan_for(host(mps_available=True), precision="bf16")
    opted = plan_for(host(mps_available=True), mps_fallback=True)
    assert opted.mps_fallback and opted.env["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"
    user = plan_for(host(mps_available=True, user_env={"PYTORCH_ENABLE_MPS_FALLBACK": "1"}))
    assert user.mps_fallback and "set by the user" in user.reasons["mps_fallback"] and user.env == {}
    assert not plan_for(host(mps_available=True), "cpu", mps_fallback=True).mps_fallback
    legacy = host(mps_available=True, mps_bf16=True, mps_autocast=False)
    assert plan_for(legacy).autocast_dtype is None
    with pytest.raises(ConfigError, match="available: fp32$"):
        plan_for(legacy, precision="fp16")


def test_device_and_precision_errors_are_one_line():
    for spec, precision, pattern in [
        ("cuda", "auto", r"^device=cuda is not available here; available: cpu$"),
        ("mps", "auto", r"^device=mps is not available here; available: cpu$"),
        ("tpu", "auto", r"^device=tpu is unknown; valid: auto, cpu, cuda, cuda:N, mps$"),
        ("cpu", "int8", r"^precision=int8 is unknown; valid: auto, fp32, bf16, fp16$"),
    ]:
        with pytest.raises(ConfigError, match=pattern) as err:
            plan_for(host(), spec, precision)
        assert "\n" not in str(err.value)


def test_every_decision_has_a_reason_and_the_plan_serialises():
    for facts in [host("graviton3"), host(cuda=gpu(7, 5)), host(mps_available=True)]:
        plan = plan_for(facts)
        keys = [row[0] for row in plan.rows()]
        assert all(plan.reasons[k] for k in keys)
        assert set(keys) <= set(plan.table().split()) | {"data_loading", "mps_fallback"}
        data = json.loads(json.dumps(plan.as_dict()))
        assert data["device"] == str(plan.device) and data["facts"]["cpu"]["graviton"] == facts.cpu.graviton


def test_autocast_and_grad_scaler_follow_the_plan():
    plan = plan_for(host("x86_amx"))
    with plan.autocast():
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype is torch.bfloat16
    assert not plan.make_grad_scaler().is_enabled()
    with plan_for(host("x86_avx2")).autocast():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype is torch.float32


def test_optimizer_impl_choice_runs_and_matches_plain_adamw():
    # the plan's AdamW implementation on this machine's torch steps like the single-tensor reference
    plan = resolve("cpu", "fp32")
    assert plan.optimizer_impl == ("fused" if "cpu" in plan.facts.fused_adamw_devices else "default")
    params = [
        torch.randn(5, 3, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)
    ]
    twins = [p.detach().clone().requires_grad_() for p in params]
    kwargs = {plan.optimizer_impl: True} if plan.optimizer_impl != "default" else {}
    ours = torch.optim.AdamW(params, lr=1e-2, **kwargs)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    for _ in range(3):
        for group in (params, twins):
            for p in group:
                p.grad = p.detach().sin()
        ours.step()
        ref.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- live detection, monkeypatched devices


def fake_accelerators(monkeypatch, caps: list[tuple[int, int]], mps: bool, mps_bf16: bool = True) -> None:
    """Make torch report `caps` CUDA devices and MPS availability, as the real calls would."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"fake sm{caps[i][0]}{caps[i][1]}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(facts_mod, "_mps_bf16", lambda: mps_bf16)


@pytest.mark.parametrize(
    "cap, dtype, scaler, matmul, backends",
    [
        ((7, 0), torch.float16, True, "ieee", ("sdpa", "math")),
        ((8, 0), torch.bfloat16, False, "tf32", ("sdpa", "triton", "math")),
        ((9, 0), torch.bfloat16, False, "tf32", ("sdpa", "triton", "math")),
    ],
)
def test_resolve_with_monkeypatched_cuda(monkeypatch, cap, dtype, scaler, matmul, backends):
    fake_accelerators(monkeypatch, [cap], mps=False)
    plan = resolve(facts=dataclasses.replace(detect(env={}), triton=True))
    assert plan.device == torch.device("cuda", 0) and plan.facts.cuda[0].capability == cap
    assert (plan.autocast_dtype, plan.grad_scaler, plan.matmul_fp32_precision) == (dtype, scaler, matmul)
    assert plan.attention_backends == backends and plan.pin_memory


def test_resolve_with_monkeypatched_mps_and_mixed_gpus(monkeypatch):
    fake_accelerators(monkeypatch, [], mps=True, mps_bf16=False)
    plan = resolve()
    assert plan.device == torch.device("mps") and plan.autocast_dtype is None and not plan.pin_memory
    fake_accelerators(monkeypatch, [(7, 0), (9, 0)], mps=True)
    facts = detect(env={})
    assert [c.capability for c in facts.cuda] == [(7, 0), (9, 0)] and facts.mps_available and facts.mps_bf16
    assert resolve(facts=facts).autocast_dtype is torch.float16  # auto -> cuda:0, the sm70 card
    assert resolve("cuda:1", facts=facts).matmul_fp32_precision == "tf32"
    assert resolve("mps", facts=facts).autocast_dtype is torch.bfloat16


def test_resolve_on_this_machine_matches_its_facts():
    facts = detect()
    plan = resolve()
    assert plan.device.type == ("cuda" if facts.cuda else "mps" if facts.mps_available else "cpu")
    if plan.device.type == "cpu":
        assert (plan.autocast_dtype is torch.bfloat16) == facts.cpu.bf16
    assert dataclasses.replace(plan.facts, load_average=None) == dataclasses.replace(facts, load_average=None)


def test_busy_host_warns_about_threads_but_keeps_the_count():
    quiet, busy = plan_for(host("x86_amx", load_average=0.5)), plan_for(host("x86_amx", load_average=11.0))
    assert quiet.num_threads == busy.num_threads == 2  # the count stays a function of the hardware
    assert "WARNING" not in quiet.reasons["threads"] and quiet.warnings == ()
    assert len(busy.warnings) == 1 and busy.warnings[0].startswith("WARNING: load average 11.0")
    assert (
        "load average 11.0 on 4 CPUs" in busy.reasons["threads"]
        and "OMP_NUM_THREADS=1" in busy.reasons["threads"]
    )


# ---------------------------------------------------------------- runtime settings, read back in a subprocess

APPLY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from core.device import DeviceFacts, detect_cpu, plan_for
    from core.device.facts import USER_ENV_KEYS, CudaFacts
    results = {}
    for name, spec in json.loads(sys.argv[1]).items():
        # each scenario starts from the user's environment alone, as a fresh launch would
        for key in USER_ENV_KEYS:
            os.environ.pop(key, None)
        os.environ.update(spec["env"])
        cpu = detect_cpu(open(spec["cpuinfo"]).read())
        cuda = tuple(CudaFacts(0, "sim", tuple(spec["cuda"])) for _ in [0] if spec["cuda"])
        facts = DeviceFacts(cpu=cpu, cuda=cuda, user_env=spec["env"], mkldnn_fp32_precision_api=spec["api"])
        plan_for(facts).apply()
        READ_BACK = ["OMP_NUM_THREADS", "LRU_CACHE_CAPACITY", "THP_MEM_ALLOC_ENABLE",
                     "DNNL_DEFAULT_FPMATH_MODE"]
        out = {
            "threads": torch.get_num_threads(),
            "mkldnn_matmul": torch.backends.mkldnn.matmul.fp32_precision,
            "mkldnn_conv": torch.backends.mkldnn.conv.fp32_precision,
            "cuda_matmul": torch.backends.cuda.matmul.fp32_precision,
            "cudnn_conv": torch.backends.cudnn.conv.fp32_precision,
            "env": {k: os.environ.get(k) for k in READ_BACK},
        }
        # does oneDNN now compute fp32 matmuls in bf16? then the error against float64 jumps to bf16 level
        a, b = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).chunk(2)
        ref = a.double() @ b.double().T
        out["matmul_rel_err"] = ((a @ b.T).double() - ref).abs().max().item() / ref.abs().max().item()
        results[name] = out
    print(json.dumps(results))
    """
)

SCENARIOS = {
    "graviton3": ("graviton3", {"LOCAL_WORLD_SIZE": "4"}, True, None),
    "graviton2_user_threads": ("graviton2", {"OMP_NUM_THREADS": "1"}, True, None),
    "graviton3_old_torch": ("graviton3", {}, False, None),
    "cuda_sm80": ("x86_avx2", {}, True, [8, 0]),
    "cuda_sm70": ("x86_avx2", {}, True, [7, 0]),
}


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> dict[str, dict]:
    """Apply each scenario's plan in one fresh interpreter and read the settings back from torch there."""
    script = tmp_path_factory.mktemp("apply") / "apply_plan.py"
    script.write_text(APPLY_SCRIPT)
    spec = {
        name: {"cpuinfo": str(FIXTURES / f"cpuinfo_{cpu}.txt"), "env": env, "api": api, "cuda": cuda}
        for name, (cpu, env, api, cuda) in SCENARIOS.items()
    }
    child_env = {k: v for k, v in os.environ.items() if k not in facts_mod.USER_ENV_KEYS}
    child_env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def host_has_bf16() -> bool:
    return detect_cpu(facts_mod._read_cpuinfo()).bf16


def test_graviton3_tuning_applied_in_subprocess(applied):
    got = applied["graviton3"]
    assert got["threads"] == 2  # 8 physical cores / 4 local processes
    assert got["env"] == {
        "OMP_NUM_THREADS": "2",
        "LRU_CACHE_CAPACITY": "1024",
        "THP_MEM_ALLOC_ENABLE": "1",
        "DNNL_DEFAULT_FPMATH_MODE": None,
    }
    assert got["mkldnn_matmul"] == "bf16" and got["mkldnn_conv"] == "bf16"
    if (
        host_has_bf16()
    ):  # oneDNN honours bf16 fast math only where the CPU executes bf16 (this build host does)
        assert 1e-4 < got["matmul_rel_err"] < 2e-2, got["matmul_rel_err"]


def test_graviton2_and_env_var_route_applied_in_subprocess(applied):
    got = applied["graviton2_user_threads"]
    assert got["threads"] == 1 and got["env"]["OMP_NUM_THREADS"] == "1"  # the user's value wins
    assert got["mkldnn_matmul"] == "none" and got["env"]["THP_MEM_ALLOC_ENABLE"] == "1"
    assert got["matmul_rel_err"] < 1e-5  # full fp32 against the float64 reference
    old_torch = applied["graviton3_old_torch"]
    assert old_torch["env"]["DNNL_DEFAULT_FPMATH_MODE"] == "BF16" and old_torch["mkldnn_matmul"] == "none"


def test_cuda_tf32_settings_applied_in_subprocess(applied):
    # the fp32_precision flags are process-global and settable without a GPU: read back what the plan set
    assert (applied["cuda_sm80"]["cuda_matmul"], applied["cuda_sm80"]["cudnn_conv"]) == ("tf32", "tf32")
    assert (applied["cuda_sm70"]["cuda_matmul"], applied["cuda_sm70"]["cudnn_conv"]) == ("ieee", "ieee")


# ---------------------------------------------------------------- CLI


def test_cli_table_json_env_and_error(capsys, monkeypatch):
    assert cli_main([]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["setting", "detected", "chosen", "why"]
    assert cli_main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == str(resolve().device)
    assert cli_main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err == "error: device=tpu is unknown; valid: auto, cpu, cuda, cuda:N, mps\n"
    monkeypatch.setattr(plan_mod, "detect", lambda: host("graviton3"))
    assert cli_main(["--env"]) == 0
    assert "export LRU_CACHE_CAPACITY=1024" in capsys.readouterr().out.splitlines()


def test_cli_runs_as_module():
    proc = subprocess.run(
        [sys.executable, "-m", "core.device", "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["reasons"]["precision"]


# ---------------------------------------------------------------- one dispatch layer


def test_device_checks_live_only_in_core_device():
    pattern = re.compile(r"cuda\.is_available|backends\.mps")
    offenders = []
    for top in ["core", "vision", "audio", "text", "recipes", "bench"]:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("core", "device"):
                continue
            offenders += [
                f"{rel}:{i}"
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if pattern.search(line)
            ]
    assert offenders == [], f"device checks outside core/device: {offenders}"
    # and the rule has teeth: core/device itself does contain them
    assert pattern.search((ROOT / "core/device/facts.py").read_text())
