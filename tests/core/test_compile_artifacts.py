"""The compile-artifact file: torch's cache artifacts plus the CPU kernels this process loaded."""

from __future__ import annotations

import _ctypes
import ctypes
import json
import logging
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from core import compile as kc
from core.compile import artifacts as ca

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernels are carried on Linux")

KERNEL = "ab/cabcdef.main.so"  # Inductor's layout: <2 chars of the key>/<key>.main.so
UNUSED = "cd/ccdunused.main.so"
PROBE = "yx/cyxprobe.so"


@pytest.fixture(autouse=True)
def _restore_inductor_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # load_artifacts points Inductor at its cache dir through the environment; undone after each test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))


@pytest.fixture
def cache_a(tmp_path: Path) -> Path:
    """A cache dir with one kernel this process loads, one it never loads and an ISA probe."""
    root = tmp_path / "cache_a"
    lib = Path(_ctypes.__file__)  # any real shared library stands in for a g++-built kernel
    for rel in (KERNEL, UNUSED, PROBE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib, root / rel)
    (root / (PROBE + ca.PROBE_OK)).write_text("")
    ctypes.CDLL(str(root / KERNEL))  # mapped into this process, as Inductor's loaded kernels are
    return root


def test_loaded_kernels_are_the_mapped_libraries_under_the_cache_dir(cache_a: Path) -> None:
    assert ca.loaded_kernels(cache_a) == [(cache_a / KERNEL).resolve()]
    assert ca.probe_binaries(cache_a) == [cache_a / PROBE]


def test_kernels_travel_to_a_fresh_cache_dir(
    cache_a: Path, tmp_path: Path, torch_artifacts: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    art = tmp_path / "ckpt" / "compile_artifacts.bin"
    assert kc.save_artifacts(art, kc.CompileConfig(cache_dir=str(cache_a)))
    names = zipfile.ZipFile(art).namelist()
    expected = [ca.TORCH_BLOB, ca.MACHINE, "kernels/" + KERNEL, "kernels/" + PROBE, ca.SIGNATURE]
    assert sorted(names) == sorted(expected) and ca.is_own(art)

    cache_b = tmp_path / "cache_b"
    with caplog.at_level(logging.INFO, logger="torchkiln.compile"):
        assert kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(cache_b)))
    assert torch_artifacts == [b"graphs"]
    assert (cache_b / KERNEL).read_bytes() == (cache_a / KERNEL).read_bytes()
    assert (cache_b / PROBE).is_file()
    # the probe's load-ok marker stays behind: the new machine runs the probe on its own CPU
    assert not (cache_b / (PROBE + ca.PROBE_OK)).exists() and not (cache_b / UNUSED).exists()
    assert "2 C++ kernels restored into" in caplog.text
    ctypes.CDLL(str(cache_b / KERNEL))  # a loadable library, not a half-written one


def test_kernels_from_another_machine_are_not_restored(
    cache_a: Path, tmp_path: Path, torch_artifacts: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    art = tmp_path / "compile_artifacts.bin"
    assert kc.save_artifacts(art, kc.CompileConfig(cache_dir=str(cache_a)))
    other = dict(ca.machine_fingerprint() or {}, cpu_features="0" * 16)
    with zipfile.ZipFile(art) as src, zipfile.ZipFile(tmp_path / "other.bin", "w") as dst:
        for name in src.namelist():
            if name != ca.SIGNATURE:
                dst.writestr(name, json.dumps(other) if name == ca.MACHINE else src.read(name))
    ca.sign(tmp_path / "other.bin")  # this user's file, from another machine

    cache_b = tmp_path / "cache_b"
    with caplog.at_level(logging.INFO, logger="torchkiln.compile"):
        assert kc.load_artifacts(tmp_path / "other.bin", kc.CompileConfig(cache_dir=str(cache_b)))
    assert torch_artifacts == [b"graphs"]  # torch checks its own entries; only the binaries are refused
    assert not (cache_b / KERNEL).exists()
    assert "C++ kernels built on another machine or torch" in caplog.text


def test_entries_outside_the_cache_dir_are_refused(
    tmp_path: Path, torch_artifacts: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    art = tmp_path / "evil.bin"
    with zipfile.ZipFile(art, "w") as zf:
        zf.writestr(ca.MACHINE, json.dumps(ca.machine_fingerprint()))
        zf.writestr("kernels/../../escaped.so", b"x")
        zf.writestr("kernels/ok/cok.main.so", b"y")
    cache_b = tmp_path / "deep" / "cache_b"
    # even a trusted file writes nothing outside the cache dir
    assert kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(cache_b), trust_artifacts=True))
    assert not (tmp_path / "escaped.so").exists() and not (tmp_path / "deep" / "escaped.so").exists()
    assert (cache_b / "ok" / "cok.main.so").read_bytes() == b"y"
    assert "skipping entry 'kernels/../../escaped.so'" in caplog.text


def test_an_earlier_checkpoints_raw_torch_artifacts_load_only_when_trusted(
    tmp_path: Path, torch_artifacts: list[bytes]
) -> None:
    art = tmp_path / "compile_artifacts.bin"
    art.write_bytes(b"raw torch artifact bytes")  # the format before kernels were carried: unsigned
    assert not kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(tmp_path / "c")))
    assert torch_artifacts == []  # torch's (pickle) loader never saw the bytes
    assert kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(tmp_path / "c"), trust_artifacts=True))
    assert torch_artifacts == [b"raw torch artifact bytes"]


def test_a_damaged_artifact_file_only_costs_a_cold_start(
    cache_a: Path, tmp_path: Path, torch_artifacts: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    art = tmp_path / "compile_artifacts.bin"
    assert kc.save_artifacts(art, kc.CompileConfig(cache_dir=str(cache_a)))
    data = bytearray(art.read_bytes())
    data[40:200] = b"\0" * 160  # inside the first entry: the zip directory still parses
    art.write_bytes(bytes(data))
    assert not kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(tmp_path / "c")))
    assert f"ignoring compile artifacts {art}" in caplog.text


def test_nothing_to_carry_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None, raising=False)
    art = tmp_path / "compile_artifacts.bin"
    assert not kc.save_artifacts(art, kc.CompileConfig(cache_dir=str(tmp_path / "empty")))
    assert not art.exists()


#: a shared library whose constructor runs on load: what a crafted "kernel" in a foreign checkpoint does
PLANTED_C = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("TORCHKILN_PLANTED_MARKER"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _planted_library(tmp_path: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    src, lib = tmp_path / "planted.c", tmp_path / "planted.so"
    src.write_text(PLANTED_C)
    subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_a_foreign_checkpoints_kernels_and_pickles_never_run_unless_trusted(
    tmp_path: Path, torch_artifacts: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a checkpoint from someone else: a planted kernel and torch bytes, machine fingerprint matching ours
    marker = tmp_path / "marker"
    monkeypatch.setenv("TORCHKILN_PLANTED_MARKER", str(marker))
    art = tmp_path / "foreign" / "compile_artifacts.bin"
    art.parent.mkdir()
    with zipfile.ZipFile(art, "w") as zf:
        zf.writestr(ca.TORCH_BLOB, b"pickled code")
        zf.writestr(ca.MACHINE, json.dumps(ca.machine_fingerprint()))
        zf.write(_planted_library(tmp_path), "kernels/" + KERNEL)
        zf.writestr(ca.SIGNATURE, "0" * 64)  # a forged signature is no signature
    cache = tmp_path / "shared_cache"
    assert not kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(cache)))
    assert torch_artifacts == [] and not list(cache.rglob("*.so"))  # nothing planted for a later run
    assert not marker.exists()
    # opted in, the file is restored as it is: Inductor loading that kernel later runs its code
    assert kc.load_artifacts(art, kc.CompileConfig(cache_dir=str(cache), trust_artifacts=True))
    assert torch_artifacts == [b"pickled code"] and (cache / KERNEL).is_file()
    ctypes.CDLL(str(cache / KERNEL))
    assert marker.read_text() == "ran"


def test_a_tampered_own_file_is_not_trusted(
    cache_a: Path, tmp_path: Path, torch_artifacts: list[bytes]
) -> None:
    art = tmp_path / "compile_artifacts.bin"
    assert kc.save_artifacts(art, kc.CompileConfig(cache_dir=str(cache_a))) and ca.is_own(art)
    edited = tmp_path / "edited.bin"
    with zipfile.ZipFile(art) as src, zipfile.ZipFile(edited, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            dst.writestr(name, data + b"\0" if name == "kernels/" + KERNEL else data)
    assert not ca.is_own(edited)
    assert not kc.load_artifacts(edited, kc.CompileConfig(cache_dir=str(tmp_path / "c")))
    assert torch_artifacts == [] and not (tmp_path / "c" / KERNEL).exists()


def test_the_signing_key_is_the_users_alone_and_stable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path / "cache"))
    key = ca.user_key()
    path = tmp_path / "cache" / "keys" / "compile-artifacts.key"
    assert len(key) == 32 and ca.user_key() == key and path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("TORCHKILN_CACHE", str(tmp_path / "other-user"))
    assert ca.user_key() != key  # another cache (another user's) signs differently
