"""The compile-artifact file saved beside checkpoints: torch's cache artifacts plus Inductor's CPU kernels.

`torch.compiler.save_cache_artifacts` carries FX-graph and AOTAutograd results (and Triton kernels on GPU),
but not the C++ kernels Inductor builds with g++ on CPU: a run resumed into an empty cache dir rebuilt every
kernel (BENCHMARKS.md § Compile), about as slow as a cold start. This file format adds the kernel binaries
that this process loaded from the cache dir, plus the binaries of Inductor's vector-ISA probes, so a resumed
or repeated run in a fresh cache dir skips g++. Kernels are built with `-march=native`, so they are restored
only on a machine with the same CPU features, torch and Python; elsewhere they are rebuilt as before.

The file is a zip: `torch_cache_artifacts.bin` (torch's bytes, when it had any), `machine.json`,
`kernels/<path under the cache dir>` and `signature`. Torch's artifacts are pickles and kernels are native
code, so loading a file runs whatever it holds: `read` restores nothing unless the file is this user's own,
i.e. its `signature` is the HMAC-SHA256 of its other members under a key that only this user's cache holds
(`$TORCHKILN_CACHE/keys/compile-artifacts.key`, made on first use, mode 0600), or the caller trusts it
explicitly (`compile.trust_artifacts=true`). A file that is not a zip (earlier checkpoints' format: torch's
bytes alone) carries no signature.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import platform
import secrets
import sys
import zipfile
from pathlib import Path, PurePosixPath

import torch

from core.files import cache_root

log = logging.getLogger("torchkiln.compile")

FORMAT = 1
TORCH_BLOB = "torch_cache_artifacts.bin"
MACHINE = "machine.json"
KERNELS = "kernels/"
SIGNATURE = "signature"
#: Inductor marks an ISA probe that loaded and ran on this CPU with this file beside the probe binary;
#: the marker is never carried over, so the new machine runs the probe itself
PROBE_OK = ".load_ok"


def machine_fingerprint() -> dict[str, object] | None:
    """What a kernel binary depends on besides its source (CPU features, torch, Python); None off Linux."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    # x86 lists "flags", aarch64 "Features": the ISA extensions -march=native may have used
    lines = (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    features = next((value for key, value in lines if key.strip() in ("flags", "Features")), "")
    return {
        "format": FORMAT,
        "arch": platform.machine(),
        "cpu_features": hashlib.sha256(" ".join(sorted(features.split())).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }


def loaded_kernels(root: Path) -> list[Path]:
    """Shared libraries under `root` that this process has mapped (Linux /proc/self/maps); [] elsewhere."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    root = root.resolve()
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".so"):  # "(deleted)" files end otherwise: skipped
            lib = Path(fields[5])
            if lib.is_relative_to(root) and lib.is_file():
                found.add(lib)
    return sorted(found)


def probe_binaries(root: Path) -> list[Path]:
    """Inductor's vector-ISA probe binaries in `root` (each has a load-ok marker beside it)."""
    return sorted(p.with_name(p.name[: -len(PROBE_OK)]) for p in root.glob(f"*/*.so{PROBE_OK}"))


def user_key() -> bytes:
    """This user's artifact-signing key, made on first use (32 random bytes, readable by the user alone)."""
    path = cache_root() / "keys" / "compile-artifacts.key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)  # never replaces a key another process made first: files it signed stay valid
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


def _mac(zf: zipfile.ZipFile, key: bytes) -> str:
    """HMAC-SHA256 over every member but the signature: names and bytes, in name order."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in sorted(n for n in zf.namelist() if n != SIGNATURE):
        data = zf.read(name)
        mac.update(f"{name}\0{len(data)}\0".encode())
        mac.update(data)
    return mac.hexdigest()


def sign(path: Path) -> None:
    """Add this user's signature to the artifact zip at `path` (written by `write`, or by a test)."""
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(SIGNATURE, _mac(zf, user_key()))


def is_own(path: Path) -> bool:
    """Whether the artifact file at `path` carries this user's valid signature."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        if SIGNATURE not in zf.namelist():
            return False
        return hmac.compare_digest(zf.read(SIGNATURE).decode("ascii", "replace"), _mac(zf, user_key()))


def write(path: Path, torch_blob: bytes | None, root: Path) -> bool:
    """Write the artifact file at `path` atomically; False (nothing written) if there is nothing to carry."""
    fingerprint = machine_fingerprint()
    libs = (loaded_kernels(root) + probe_binaries(root)) if fingerprint is not None else []
    libs = sorted({lib.resolve() for lib in libs if lib.is_file()})
    if torch_blob is None and not libs:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    root = root.resolve()
    # stored, not deflated: ~100 KB a kernel, and this runs at every checkpoint of a compiled run
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        if torch_blob is not None:
            zf.writestr(TORCH_BLOB, torch_blob)
        zf.writestr(MACHINE, json.dumps(fingerprint))
        for lib in libs:
            zf.write(lib, KERNELS + lib.relative_to(root).as_posix())
    sign(tmp)
    tmp.replace(path)  # atomic, so a crash mid-write never leaves a truncated artifact file
    return True


def _safe_relative(name: str) -> PurePosixPath | None:
    rel = PurePosixPath(name[len(KERNELS) :])
    if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.suffix != ".so":
        return None
    return rel


def read(path: Path, root: Path, trust: bool = False) -> tuple[bytes | None, int]:
    """Restore the artifact file's kernels into cache dir `root`; return (torch's bytes, kernels restored).
    Unless `trust`, a file that is not this user's own (`is_own`) restores nothing and returns no bytes."""
    if not trust and not is_own(path):
        log.info(
            "compile artifacts %s are not signed by this user: ignored, compiling cold (they can hold "
            "code; compile.trust_artifacts=true loads artifacts of runs you trust)",
            path,
        )
        return None, 0
    if not zipfile.is_zipfile(path):
        return path.read_bytes(), 0  # an earlier checkpoint's file: torch's bytes alone
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        blob = zf.read(TORCH_BLOB) if TORCH_BLOB in names else None
        kernels = [n for n in names if n.startswith(KERNELS) and not n.endswith("/")]
        if not kernels:
            return blob, 0
        saved = json.loads(zf.read(MACHINE)) if MACHINE in names else None
        here = machine_fingerprint()
        if saved != here:
            log.info(
                "compile artifacts %s: C++ kernels built on another machine or torch (%s, here %s); "
                "rebuilding them",
                path,
                saved,
                here,
            )
            return blob, 0
        restored = 0
        for name in kernels:
            rel = _safe_relative(name)
            if rel is None:
                log.warning("compile artifacts %s: skipping entry %r (not a kernel path)", path, name)
                continue
            dst = root.joinpath(*rel.parts)
            if dst.exists():
                continue  # the cache dir's own copy: same key, same code
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            tmp.write_bytes(zf.read(name))
            tmp.chmod(0o755)
            tmp.replace(dst)  # Inductor skips g++ when the binary exists, so it must never be half-written
            restored += 1
    return blob, restored
