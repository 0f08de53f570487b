"""core.compile: in-place compile keeps state dicts clean, falls back to eager, counts recompiles, decides."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import checkpoint
from core import compile as kc
from core.compile import metrics as compile_metrics_mod
from core.data.samplers import LengthBucketBatchSampler
from core.errors import CheckpointError, ConfigError
from tests.helpers import artifact_kernels, fault, kernel_files

# dynamo-only backends: they exercise tracing, guards and recompiles in well under a second per graph,
# where Inductor costs tens of seconds per cold compile on a 2-core CPU (Inductor runs in the slow tests)
FAST = "eager"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(4, d), nn.Linear(d, 2)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


X = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))


def _probe(m: nn.Module) -> None:
    m(X).sum().backward()


def test_config_rejects_unknown_values() -> None:
    kc.CompileConfig().validate()
    with pytest.raises(ConfigError) as e:
        kc.CompileConfig(policy="fast").validate()
    assert fault(e.value) == ("compile.policy", "fast", ("auto", "off", "full", "regional"))
    with pytest.raises(ConfigError) as e:
        kc.CompileConfig(dynamic="maybe").validate()
    assert fault(e.value) == ("compile.dynamic", "maybe", ("auto", "true", "false"))
    # Hydra turns `compile.dynamic=true` into a bool; both spellings are accepted
    kc.CompileConfig(dynamic=True).validate()  # type: ignore[arg-type]


def test_find_blocks_takes_repeated_non_leaf_children_or_the_declared_list() -> None:
    m = Tiny()
    assert kc.find_blocks(m) == list(m.blocks)
    assert (
        kc.find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []
    )  # leaf layers only
    m.compile_blocks = ["blocks.0", "head"]
    assert kc.find_blocks(m) == [m.blocks[0], m.head]


@pytest.mark.parametrize("policy", ["full", "regional"])
def test_state_dicts_move_between_compiled_and_eager(policy: str) -> None:
    compiled = kc.apply(_model(0), kc.CompileConfig(policy=policy), probe=_probe, backend=FAST)
    assert compiled.compile_report.compiled == policy
    eager = _model(1)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` anywhere
    eager.load_state_dict(compiled.state_dict())
    torch.testing.assert_close(eager(X), compiled(X), rtol=0, atol=0)
    other = _model(2)
    compiled.load_state_dict(other.state_dict())
    torch.testing.assert_close(compiled(X), other(X), rtol=0, atol=0)


def test_prefixed_checkpoints_load_and_clean() -> None:
    src = _model(3)
    wrapped = torch.compile(src, backend=FAST)  # the wrapper that writes `_orig_mod.` keys
    prefixed = wrapped.state_dict()
    assert all(k.startswith("_orig_mod.") for k in prefixed)
    assert kc.unwrap(wrapped) is src
    assert list(checkpoint.clean_state_dict(prefixed)) == list(src.state_dict())
    with pytest.raises(CheckpointError) as e:  # never a silent overwrite
        checkpoint.clean_state_dict({**prefixed, **src.state_dict()})
    first = next(iter(src.state_dict()))
    assert fault(e.value) == ("state_dict", first, (first,))
    dst = kc.apply(_model(4), kc.CompileConfig(policy="off"))
    dst.load_state_dict(prefixed)  # apply() makes loading accept both spellings
    torch.testing.assert_close(dst(X), src(X), rtol=0, atol=0)


def test_copy_uncompiled_gives_an_eager_copy_and_keeps_the_original_compiled() -> None:
    m = kc.apply(_model(11), kc.CompileConfig(policy="regional"), backend=FAST)
    twin = kc.copy_uncompiled(m)  # e.g. for an EMA model
    assert kc.compiled_modules(m) == list(m.blocks)
    assert kc.compiled_modules(twin) == []
    torch.testing.assert_close(twin(X), m(X), rtol=0, atol=0)


def _broken(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    raise RuntimeError("deliberately broken backend")


def test_compile_error_falls_back_to_eager_with_one_line_warning(caplog: pytest.LogCaptureFixture) -> None:
    ref = _model(5)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"):
        m = kc.apply(_model(5), kc.CompileConfig(policy="regional"), probe=_probe, backend=_broken)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("torch.compile failed (BackendCompilerFailed")
    assert "RuntimeError: deliberately broken backend" in lines[0]
    assert lines[0].endswith("running eager (compile.on_error=eager)")
    assert m.compile_report.compiled == "none"
    assert kc.compiled_modules(m) == []
    torch.testing.assert_close(m(X), ref(X), rtol=0, atol=0)


def test_backward_compile_error_falls_back_too(caplog: pytest.LogCaptureFixture) -> None:
    from torch._dynamo.backends.common import aot_autograd

    def broken_backward(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        raise RuntimeError("deliberately broken backward")

    backend = aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=broken_backward)
    ref = _model(12)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"):
        m = kc.apply(_model(12), kc.CompileConfig(policy="full"), probe=_probe, backend=backend)
    assert "deliberately broken backward" in caplog.text and m.compile_report.compiled == "none"
    assert kc.compiled_modules(m) == []
    torch.testing.assert_close(m(X), ref(X), rtol=0, atol=0)


def test_compile_error_at_first_call_without_probe_and_on_error_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref = _model(6)
    m = kc.apply(_model(6), kc.CompileConfig(policy="full"), backend=_broken)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"):
        torch.testing.assert_close(m(X), ref(X), rtol=0, atol=0)
    assert "torch.compile failed" in caplog.text and m.compile_report.compiled == "none"
    strict = kc.apply(_model(6), kc.CompileConfig(policy="full", on_error="raise"), backend=_broken)
    with pytest.raises(Exception, match="deliberately broken backend"):
        strict(X)


def test_user_errors_are_not_mistaken_for_compile_errors(caplog: pytest.LogCaptureFixture) -> None:
    m = kc.apply(_model(7), kc.CompileConfig(policy="full"), probe=_probe, backend=FAST)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"), pytest.raises(RuntimeError):
        m(torch.randn(2, 5, 3))  # wrong feature size fails in eager too: raise it, stay compiled
    assert "torch.compile failed" not in caplog.text and m.compile_report.compiled == "full"


def _slow_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    def run(*args):
        time.sleep(0.2)  # well above a loaded host's noise in the tiny model's eager step
        return gm(*args)

    return run


def test_auto_keeps_eager_when_compiled_steps_are_slower() -> None:
    m = kc.apply(
        _model(8), kc.CompileConfig(policy="auto", auto_steps=2), probe=_probe, backend=_slow_backend
    )
    r = m.compile_report
    assert r.compiled == "none" and r.compiled_step_ms > r.eager_step_ms + 100  # >= one 200 ms sleep a step
    assert "keeping eager" in r.reason and kc.compiled_modules(m) == []


def test_auto_keeps_compile_when_eager_steps_are_slower() -> None:
    def probe(m: Tiny) -> None:
        if m.blocks[0] not in kc.compiled_modules(m):
            time.sleep(0.15)  # injected eager cost: makes the measured decision deterministic
        _probe(m)

    cfg = kc.CompileConfig(policy="auto", auto_candidates=["regional"])
    m = kc.apply(_model(9), cfg, probe=probe, backend=FAST)
    r = m.compile_report
    assert r.compiled == "regional" and r.blocks == 3 and "keeping compile" in r.reason
    assert kc.compiled_modules(m) == list(m.blocks)
    assert kc.decide(10.0, 9.9, 1.02)[0] is False and kc.decide(10.0, 9.0, 1.02)[0] is True


def test_auto_tries_each_candidate_and_keeps_the_fastest() -> None:
    def probe(m: Tiny) -> None:
        if m not in kc.compiled_modules(m):
            time.sleep(0.15)  # injected: only the whole-model compile is fast
        _probe(m)

    cfg = kc.CompileConfig(policy="auto", auto_candidates=["regional", "full"], auto_steps=2)
    m = kc.apply(_model(13), cfg, probe=probe, backend=FAST)
    r = m.compile_report
    assert r.compiled == "full" and "also tried regional" in r.reason, r.reason
    assert kc.compiled_modules(m) == [m]
    with pytest.raises(ConfigError) as e:
        kc.CompileConfig(auto_candidates=["everything"]).validate()
    assert fault(e.value) == ("compile.auto_candidates", "[everything]", ("full", "regional"))


def test_auto_picks_candidates_by_device_when_none_are_listed() -> None:
    assert kc.default_auto_candidates("cpu") == ["full"]  # CPU: whole-model graphs measured faster
    assert kc.default_auto_candidates("cuda") == ["regional"] == kc.default_auto_candidates("mps")

    def probe(m: Tiny) -> None:
        if m not in kc.compiled_modules(m):
            time.sleep(0.15)  # injected eager cost, as above
        _probe(m)

    m = kc.apply(_model(17), kc.CompileConfig(policy="auto").validate(), probe=probe, backend=FAST)
    assert m.compile_report.compiled == "full" and kc.compiled_modules(m) == [m]  # a CPU model


def test_probe_steps_leave_rng_and_buffers_untouched() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    torch.manual_seed(0)
    kc.apply(
        m,
        kc.CompileConfig(policy="full"),
        probe=lambda m: m(torch.randn(8, 4)).sum().backward(),
        backend=FAST,
    )
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))
    assert int(m[1].num_batches_tracked) == 0 and torch.equal(m[1].running_mean, torch.zeros(4))


def _length_batches(sampler: LengthBucketBatchSampler | None, lengths: list[int], bs: int):
    order = sampler.batches(0) if sampler else [list(range(i, i + bs)) for i in range(0, len(lengths), bs)]
    g = torch.Generator().manual_seed(0)
    for idx in order:
        longest = max(lengths[i] for i in idx)
        t = sampler.padded_length(longest) if sampler else longest
        yield torch.randn(len(idx), t, 4, generator=g)


def test_variable_lengths_recompile_at_most_three_times(caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(8, 160) for _ in range(150)]
    assert len(set(lengths)) >= 50
    sampler = LengthBucketBatchSampler(lengths, 6, shuffle=True, seed=0, num_buckets=6)
    for policy in ("regional", "full"):
        torch._dynamo.reset()
        m = kc.apply(_model(10), kc.CompileConfig(policy=policy), backend=FAST)
        for x in _length_batches(sampler, lengths, 6):
            m(kc.mark_dynamic_batch(x, dims=(0, 1))).sum().backward()
        metrics = kc.compile_metrics()
        assert metrics["compile/compiles"] >= 1 and metrics["compile/recompiles"] <= 3, (policy, metrics)
    # control: the same epoch unbucketed with static shapes recompiles until dynamo's limit and warns
    torch._dynamo.reset()
    cfg = kc.CompileConfig(policy="full", dynamic="false", max_recompiles=4, on_recompile_limit="warn")
    m = kc.apply(_model(10), cfg, backend=FAST)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"):
        for x in list(_length_batches(None, lengths, 6))[:10]:  # 10 raw lengths outrun the limit of 8
            m(x).sum().backward()
    assert kc.compile_metrics()["compile/recompiles"] >= 7
    assert "recompiled 5 times in" in caplog.text and "compile.max_recompiles=4" in caplog.text


class Broken(nn.Module):
    """Three linears with a data-dependent branch between each two: graph breaks, three compiled frames."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > -1e9:  # dynamo cannot branch on a tensor's value: it splits the graph here
            x = x * 1.0
        x = self.b(x)
        if x.sum() > -1e9:
            x = x * 1.0
        return self.c(x)


def test_the_recompile_bound_counts_each_frame() -> None:
    # a model that graph breaks recompiles every frame on one new input (the LM preset's evaluation under
    # no_grad: ten recompiles over its frames, one each, took its compile away at the first evaluation):
    # the bound is on one frame's recompiles, as dynamo's own limit is
    torch._dynamo.reset()
    cfg = kc.CompileConfig(policy="full", dynamic="false", max_recompiles=3)
    m, ref = kc.apply(Broken(), cfg, backend=FAST), Broken()
    for n in (2, 3, 5):  # static shapes: each new batch size recompiles each of the three frames
        x = torch.randn(n, 4)
        assert torch.allclose(m(x), ref(x), atol=1e-6)
    assert torch.allclose(m(x), ref(x), atol=1e-6)  # a seen shape: the bound is checked on each call
    metrics = kc.compile_metrics()
    assert metrics["compile/compiles"] == 9 and metrics["compile/recompiles"] == 6  # 2 a frame
    assert kc.compiled_modules(m) == [m] and m.compile_report.compiled == "full"
    for n in (7, 11, 13):  # the 4th recompile of a frame passes the bound of 3: eager from then on
        x = torch.randn(n, 4)
        assert torch.allclose(m(x), ref(x), atol=1e-6)
    assert kc.compiled_modules(m) == [] and m.compile_report.compiled == "none"
    assert "4 of one frame" in m.compile_report.reason
    torch._dynamo.reset()


def test_past_the_recompile_bound_the_model_runs_eager(caplog: pytest.LogCaptureFixture) -> None:
    # the default on_recompile_limit=eager: a model that keeps recompiling stops compiling, with one warning
    m = kc.apply(_model(11), kc.CompileConfig(policy="full", dynamic="false", max_recompiles=2), backend=FAST)
    ref = _model(11)
    with caplog.at_level(logging.WARNING, logger="torchkiln.compile"):
        for t in range(3, 11):  # a new static shape every call
            x = torch.randn(2, t, 4)
            assert torch.allclose(m(x), ref(x), atol=1e-6)
    assert kc.compile_metrics()["compile/recompiles"] == 3  # the call after the 3rd recompile ran eager
    assert kc.compiled_modules(m) == [] and m.compile_report.compiled == "none"
    assert "3 recompiles in" in m.compile_report.reason
    assert "compile.max_recompiles=2" in m.compile_report.reason
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "running eager from here" in lines[0], lines
    with pytest.raises(ConfigError) as e:
        kc.CompileConfig(on_recompile_limit="never").validate()
    assert fault(e.value) == ("compile.on_recompile_limit", "never", ("eager", "warn"))


def test_past_the_recompile_seconds_bound_the_model_runs_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that moves only while the compiler "works", so each compile takes exactly 0.5 s whatever the
    # host's speed (a real sleep plus dynamo's own tracing time made the count depend on the machine's load).
    clock = [0.0]
    monkeypatch.setattr(compile_metrics_mod, "_compile_clock", lambda: clock[0])

    def slow_compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        clock[0] += 0.5  # stands in for a long (dynamic-shape) Inductor compile
        return gm

    cfg = kc.CompileConfig(policy="full", dynamic="false", max_recompiles=50, max_recompile_seconds=1.4)
    m = kc.apply(_model(12), cfg, backend=slow_compiler)
    for t in range(3, 11):
        m(torch.randn(2, t, 4))
    # bound max(1.4 s, 4x the 0.5 s first compile) = 2.0 s: 4 recompiles (2.0 s) stay within it (a bucketed
    # epoch's 3 plus an eval-mode one), the 5th (2.5 s) passes it, and from the next call the model runs eager
    assert kc.compile_metrics()["compile/recompiles"] == 5, kc.compile_metrics()
    assert (
        kc.compiled_modules(m) == []
        and "2.0 s from compile.max_recompile_seconds=1.4" in m.compile_report.reason
    )
    assert "4x the first compile" in m.compile_report.reason
    # a configured bound above 4x the first compile is the one that holds
    torch._dynamo.reset()
    clock[0] = 0.0
    cfg = kc.CompileConfig(policy="full", dynamic="false", max_recompiles=50, max_recompile_seconds=2.9)
    m = kc.apply(_model(12), cfg, backend=slow_compiler)
    for t in range(3, 12):
        m(torch.randn(2, t, 4))
    assert kc.compile_metrics()["compile/recompiles"] == 6 and kc.compiled_modules(m) == []
    assert "2.9 s from compile.max_recompile_seconds=2.9" in m.compile_report.reason
    with pytest.raises(ConfigError) as e:
        kc.CompileConfig(max_recompile_seconds=-1).validate()
    assert fault(e.value) == ("compile.max_recompile_seconds", "-1", (">= 0",))


def test_graph_breaks_are_counted() -> None:
    class Breaks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x + 1
            torch._dynamo.graph_break()
            return y * 2

    m = kc.apply(Breaks(), kc.CompileConfig(policy="full"), backend=FAST)
    m(X)
    assert kc.compile_metrics()["compile/graph_breaks"] >= 1


def test_cache_dir_follows_config_then_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path / "root"))
    assert kc.cache_dir() == tmp_path / "root" / "compile"
    assert kc.cache_dir(kc.CompileConfig(cache_dir=str(tmp_path / "c"))) == tmp_path / "c"
    monkeypatch.delenv("TORCHKILN_CACHE")
    assert kc.cache_dir() == Path.home() / ".cache" / "torchkiln" / "compile"


@pytest.mark.slow
def test_inductor_regional_matches_eager_and_artifacts_warm_a_new_process(tmp_path: Path) -> None:
    """Inductor end to end: regional output equals eager (fp32, atol 1e-5); the cache dir and saved
    artifacts make later processes start warm."""
    script = textwrap.dedent(
        """
        import sys, torch
        from tests.core.test_compile import Tiny, X
        from core import compile as kc
        cache, art, mode = sys.argv[1], sys.argv[2], sys.argv[3]
        cfg = kc.CompileConfig(policy="regional", cache_dir=cache)
        if mode == "warm":
            assert kc.load_artifacts(art, cfg)
        torch.manual_seed(0); ref = Tiny(); torch.manual_seed(0); m = Tiny()
        kc.apply(m, cfg, probe=lambda m: m(X).sum().backward())
        torch.testing.assert_close(m(X), ref(X), rtol=1e-5, atol=1e-5)
        assert m.compile_report.compiled == "regional"
        if mode == "cold":
            assert kc.save_artifacts(art)
        mt = kc.compile_metrics()
        print(m.compile_report.compile_seconds, mt["compile/cache_hits"], mt["compile/cache_misses"])
        """
    )
    root = Path(__file__).resolve().parents[2]
    art = tmp_path / "compile.artifacts"

    def run(cache: str, mode: str) -> tuple[float, float, float]:
        out = subprocess.run(
            [sys.executable, "-c", script, cache, str(art), mode],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seconds, hits, misses = out.stdout.strip().splitlines()[-1].split()
        return float(seconds), float(hits), float(misses)

    cold = run(str(tmp_path / "cache_a"), "cold")
    built = kernel_files(tmp_path / "cache_a")
    warm = run(str(tmp_path / "cache_a"), "same-dir")
    moved = run(str(tmp_path / "cache_b"), "warm")  # a fresh cache dir: only the artifacts can warm it
    # warm means nothing compiled again: graphs come from the caches (hits, no misses) and no C++ kernel is
    # built. The artifacts carry the FX/AOTAutograd results and the kernels torch's own artifacts leave out,
    # so the fresh cache dir holds exactly the carried kernels. Times: BENCHMARKS.md § Compile.
    print(f"(seconds, cache hits, cache misses): cold {cold}, warm {warm}, artifacts {moved}")
    assert cold[1] == 0 and cold[2] >= 1 and warm[1] >= 1 and moved[1] >= 1, (cold, warm, moved)
    assert warm[2] == 0 and moved[2] == 0, (warm, moved)
    assert built and kernel_files(tmp_path / "cache_a") == built  # the warm process built no kernel
    assert kernel_files(tmp_path / "cache_b") == artifact_kernels(art) != set()  # nor did the moved one
    # the kernel header the first compile used is kept with the cache dir (a reboot empties the temp dir)
    assert list((tmp_path / "cache_a" / "precompiled_headers").glob("*.h.gch"))


def test_the_precompiled_header_outlives_the_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Inductor's kernel header lives in a temp dir that a reboot empties; the cache dir keeps a copy and
    # puts it back. (Pointing Inductor's private _HEADER_DIR at a test dir also fails loudly, here, if a
    # torch upgrade renames it.)
    from torch._inductor import codecache

    temp = tmp_path / "tmp" / "precompiled_headers"
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(temp))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # configure_cache sets it
    temp.mkdir(parents=True)
    (temp / "abc.h").write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    (temp / "abc.h.gch").write_bytes(b"pch" * 1000)
    (temp / "half.h.gch").write_bytes(b"p")  # no .h beside it: not a finished header, left alone
    cfg = kc.CompileConfig(cache_dir=str(tmp_path / "cache"))

    kc.configure_cache(cfg)  # a first compile's header is kept by the cache dir (a hard link: no disk)
    kept = tmp_path / "cache" / "precompiled_headers"
    assert sorted(p.name for p in kept.iterdir()) == ["abc.h", "abc.h.gch"]
    assert (kept / "abc.h.gch").stat().st_ino == (temp / "abc.h.gch").stat().st_ino

    shutil.rmtree(temp)  # a reboot
    assert kc.sync_precompiled_headers(tmp_path / "cache") == 2  # what configure_cache runs first
    assert (temp / "abc.h.gch").read_bytes() == b"pch" * 1000 and (temp / "abc.h").is_file()
    assert kc.sync_precompiled_headers(tmp_path / "cache") == 0  # in step: nothing to do


def test_shape_hints_pad_to_bucket_boundaries_only_where_named() -> None:
    from core.data.samplers import LengthBucketBatchSampler
    from core.loop.task import ShapeHints

    sampler = LengthBucketBatchSampler([10, 20, 30, 40], 2, shuffle=False, seed=0, boundaries=[16, 48])
    hints = ShapeHints(bucket_pad={"x": 1}, static={"x": (1,)}, eval_dynamic={"x": (0,)})
    batch = {"x": torch.ones(2, 20, 3), "lengths": torch.tensor([20, 11])}
    out = kc.apply_shape_hints(batch, hints, sampler, training=True)
    assert out["x"].shape == (2, 48, 3) and torch.equal(out["x"][:, :20], batch["x"])
    assert out["x"][:, 20:].abs().sum() == 0 and out["lengths"] is batch["lengths"]
    # a sampler without buckets, or a batch that is no dict, passes through
    assert kc.apply_shape_hints(batch, hints, object(), training=False)["x"].shape == (2, 20, 3)
    assert kc.apply_shape_hints((batch["x"],), hints, sampler, training=True)[0] is batch["x"]


def test_lengths_round_up_to_two_buckets_a_doubling_within_the_limit() -> None:
    assert [kc.length_bucket(n, 4096) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 129, 200, 1000)] == [
        16,
        16,
        24,
        24,
        32,
        48,
        64,
        96,
        128,
        192,
        256,
        1024,
    ]
    assert kc.length_bucket(200, 230) == 230  # never past the model's positions
    assert kc.length_bucket(240, 230) == 240  # nor below the length itself


def test_only_a_compiled_model_gets_a_length_bucket_with_that_dim_static() -> None:
    model = nn.Sequential(nn.Embedding(10, 4))
    x = torch.randint(1, 10, (2, 50))
    assert kc.bucket_for_compiled(model, x, 256) is x  # eager: as it is, no padding computed
    model.compile(backend="eager")
    try:
        padded = kc.bucket_for_compiled(model, x, 256, value=7)
        assert padded.shape == (2, 64) and torch.equal(padded[:, :50], x)
        assert bool((padded[:, 50:] == 7).all())
        seen: list[int] = []

        def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:  # noqa: ARG001
            seen.append(1)
            return gm.forward

        torch.compiler.reset()
        fn = torch.compile(lambda t: t * 2, backend=counting)
        # static marks: each size compiles a static graph (unmarked, the second would compile one dynamic
        # graph that takes the third too), and a length of a bucket seen reuses its graph
        for n in (64, 96, 128, 80):
            fn(kc.bucket_for_compiled(model, torch.ones(2, n), 256))
        assert len(seen) == 3
    finally:
        torch.compiler.reset()
