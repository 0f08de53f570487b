"""Samples (a clip and its transcript, an image and its class) in sharded tar files with an index.

The layout is WebDataset's: each shard `SPLIT-NNNNN.tar` is a plain POSIX tar whose members are a sample's
files sharing its key (`000000042.flac` + `000000042.json`), so `tar`, WebDataset and any tar reader stream
it. Beside each shard, `SPLIT-NNNNN.idx.json` records every sample's key, its members' byte offsets and sizes
in the tar and the facts a sampler needs before reading (a clip's duration and transcript, an image's
class), so a run reads one sample with one seek and one read, without scanning the tar. `manifest.json`
lists the shards with their sizes and SHA-256, the inputs they were written from and the samples left out.

Writing (`prepare_samples`) is parallel over the cores, resumable and idempotent, and goes through the
steps every prepared folder does (`core.data.prepared`): each shard is written atomically, the samples each
finished shard consumed are recorded under `OUT/.work/`, a killed prepare continues at the first unwritten
shard, and a folder whose manifest records the same inputs is left as it is.

Reading (`SampleShards`) checks each shard against the manifest and its index when a run starts: a shard or
index that does not match (another size, a key the tar does not hold where the index says) is a one-line
DataError, exit 2; a shard cut short costs only the samples whose bytes are missing, counted as bad under the
run's `data.on_bad_sample`. Content is never executed: members are bytes handed to an audio or image decoder
and JSON.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import tarfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.cpuload import usable_cpus
from core.data.bad_samples import DEFAULT_POLICY, BadSample, BadSamplePolicy, BadSamples
from core.data.prepared import MANIFEST, WORK, prepare_folder
from core.errors import DataError
from core.files import file_sha256, write_text_atomic

#: the manifest's `format`: readers refuse another
FORMAT = "torchkiln-sample-shards-1"
#: a USTAR member header: one 512-byte block (keys are short, so no long-name extension block precedes it)
BLOCK = 512


@dataclass(frozen=True)
class MemberRef:
    """Where one member of a sample lies: its shard file, the byte offset of its data and its size."""

    shard: str
    offset: int
    size: int


def read_member(ref: MemberRef) -> bytes:
    """The bytes of one member; a shard that ends before them raises BadSample (the sample is damaged)."""
    f = _open(ref.shard)
    f.seek(ref.offset)
    data = f.read(ref.size)
    if len(data) < ref.size:
        raise BadSample(f"truncated shard: {len(data)} of the member's {ref.size} bytes are there")
    return data


#: shard files open in this process (a DataLoader worker keeps its own: the handles are per process)
_HANDLES: dict[str, Any] = {}
_HANDLES_PID = [os.getpid()]
#: open shards kept per process: a window of shards is read at a time (`core.data.samplers`)
MAX_OPEN = 16


def _open(path: str) -> Any:
    if _HANDLES_PID[0] != os.getpid():  # a forked worker must not share its parent's file offsets
        _HANDLES.clear()
        _HANDLES_PID[0] = os.getpid()
    f = _HANDLES.get(path)
    if f is None:
        if len(_HANDLES) >= MAX_OPEN:
            _HANDLES.pop(next(iter(_HANDLES))).close()
        try:
            f = _HANDLES[path] = open(path, "rb")  # noqa: SIM115 - kept open across reads, closed when evicted
        except OSError as e:
            raise BadSample(f"cannot open its shard ({e.strerror})") from None
    return f


@dataclass(frozen=True)
class Sample:
    """One sample of a split as its index records it: key, shard number, members and facts."""

    key: str
    shard: int
    members: dict[str, MemberRef]
    facts: dict[str, Any]

    @property
    def where(self) -> str:
        """The sample as a user finds it: `SHARD.tar:KEY`."""
        return f"{next(iter(self.members.values())).shard}:{self.key}"


# -- writing ---------------------------------------------------------------------------------------------


class TarShardWriter:
    """Writes one split's samples into tar shards of about `shard_bytes`, each atomically, with its index."""

    def __init__(self, out: Path, split: str, shard_bytes: int, done: Sequence[dict[str, Any]] = ()) -> None:
        """Continue after the shards `done` (their manifest entries) already written."""
        self.out, self.split, self.size = out, split, shard_bytes
        self.shards: list[dict[str, Any]] = list(done)
        self._file: Any = None
        self._tar: tarfile.TarFile | None = None
        self._index: list[dict[str, Any]] = []
        self._consumed = 0  # the split's samples (bad ones included) the open shard has taken

    def add(self, key: str, members: dict[str, bytes], facts: dict[str, Any]) -> dict[str, Any] | None:
        """Append one sample; once the shard reaches `shard_bytes` it is closed and its entry returned."""
        if self._tar is None:
            self._start()
        assert self._tar is not None
        entry: dict[str, Any] = {"key": key, "members": {}, **facts}
        for ext, data in members.items():
            at = self._file.tell()
            info = tarfile.TarInfo(f"{key}.{ext}")
            # no clock in the bytes: the same input writes the same shard
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            self._tar.addfile(info, io.BytesIO(data))
            entry["members"][ext] = [at + BLOCK, len(data)]
        self._index.append(entry)
        self._consumed += 1
        return self.finish() if self._file.tell() >= self.size else None

    def skip(self) -> None:
        """Count a bad sample the open shard's span of the split consumed without writing it."""
        self._consumed += 1

    def finish(self) -> dict[str, Any] | None:
        """Close the open shard (rename it into place, write its index); its manifest entry."""
        if self._tar is None:
            if not self._consumed:
                return None
            self._start()  # bad samples only: an empty shard keeps the consumed count exact for a resume
        assert self._tar is not None
        self._tar.close()  # the end-of-archive blocks
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = f"{self.split}-{len(self.shards):05d}"
        tmp, tar = self.out / f".{name}.tar.partial", self.out / f"{name}.tar"
        os.replace(tmp, tar)
        write_text_atomic(self.out / f"{name}.idx.json", json.dumps(self._index))
        entry = {
            "file": tar.name,
            "index": f"{name}.idx.json",
            "bytes": tar.stat().st_size,
            "samples": len(self._index),
            "consumed": self._consumed,
            "sha256": file_sha256(tar),
        }
        self.shards.append(entry)
        self._tar, self._file, self._index, self._consumed = None, None, [], 0
        return entry

    def _start(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self._file = open(self.out / f".{name}.tar.partial", "wb")  # noqa: SIM115 - closed in finish()
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115


def file_stamp(path: str) -> list[int] | None:
    """[size, modification time in ns] of a source file, the part of prepare's inputs that says it changed;
    None when it cannot be read (its loader then finds it bad)."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


#: what a domain's loader returns for one source sample: (members by extension, facts for the index), or the
#: reason the sample is bad
Loaded = tuple[dict[str, bytes], dict[str, Any]] | str


def prepare_samples(
    out: str | Path,
    *,
    kind: str,
    splits: dict[str, Sequence[Any]],
    load: Callable[[Any], Loaded],
    describe: Callable[[Any], str],
    inputs: dict[str, Any],
    facts: dict[str, Any] | None = None,
    shard_bytes: int = 1 << 28,
    workers: int = 0,
    policy: BadSamplePolicy = DEFAULT_POLICY,
    progress: bool = True,
    noun: str = "samples",
) -> dict[str, Any]:
    """Write each split's items (`load(item)`: a picklable function run in worker processes) into tar shards
    in `out`; the manifest, with `"status"`: "prepared", or "up to date" when `out` already holds these
    `inputs` prepared. `facts` go into the manifest (e.g. the class names)."""
    writing = SampleWriting(load, describe, shard_bytes, workers or usable_cpus(), policy, progress, noun)

    def build(dest: Path, fingerprint: str) -> dict[str, Any]:
        work = dest / WORK
        work.mkdir(exist_ok=True)
        progress_file = work / f"{fingerprint[:16]}.json"
        resumed = json.loads(progress_file.read_text()) if progress_file.is_file() else {}
        found: list[dict[str, str]] = []
        out_splits: dict[str, Any] = {}
        for split, items in splits.items():
            shards, bad = writing.write_split(dest, split, items, resumed, progress_file)
            found += [{"where": w, "why": y} for w, y in bad]
            out_splits[split] = {"samples": sum(s["samples"] for s in shards), "shards": shards}
        manifest = {"format": FORMAT, "kind": kind, "inputs_sha256": fingerprint, **(facts or {})}
        return {**manifest, "bad_samples": found, "splits": out_splits}

    return prepare_folder(
        out,
        {**inputs, "kind": kind},
        finished=lambda dest: _finished(dest, kind),
        build=build,
        outputs=("*.tar", "*.idx.json", ".*.tar.partial"),
        listed=lambda m: {
            s[k] for split in m["splits"].values() for s in split["shards"] for k in ("file", "index")
        },
    )


@dataclass(frozen=True)
class SampleWriting:
    """How `prepare_samples` writes a split: the loader, its worker processes and the bad-sample policy."""

    load: Callable[[Any], Loaded]
    describe: Callable[[Any], str]
    shard_bytes: int
    cores: int
    policy: BadSamplePolicy
    progress: bool
    noun: str

    def write_split(
        self, dest: Path, split: str, items: Sequence[Any], resumed: dict[str, Any], progress_file: Path
    ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """`items` into `split`'s shards, after those a killed prepare finished (`resumed`); (the shards'
        manifest entries, the bad samples as (where, why))."""
        from tqdm import tqdm

        writer = TarShardWriter(dest, split, self.shard_bytes, resumed.get(split, []))
        start = sum(s["consumed"] for s in writer.shards)
        bad = BadSamples(self.policy, f"split '{split}'", self.noun)
        for s in writer.shards:  # the bad samples of the shards a killed prepare finished
            for where, why in s.get("bad", []):
                bad.add(where, why)
        todo = list(items[start:])
        bar = tqdm(
            total=len(items), initial=start, desc=f"{split} shards", unit=self.noun, disable=not self.progress
        )
        ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
        pool = ctx.Pool(min(self.cores, len(todo))) if self.cores > 1 and len(todo) > 1 else None
        try:
            results: Iterable[Loaded] = (
                pool.imap(self.load, todo, chunksize=8) if pool is not None else map(self.load, todo)
            )
            shard_bad: list[list[str]] = []
            for n, (item, got) in enumerate(zip(todo, results, strict=True)):
                if isinstance(got, str):
                    bad.add(self.describe(item), got)
                    shard_bad.append([self.describe(item), got])
                    writer.skip()
                elif writer.add(f"{start + n:09d}", *got) is not None:  # a shard was finished
                    _record(writer, shard_bad, resumed, split, progress_file)
                    shard_bad = []
                bar.update()
            if writer.finish() is not None:
                _record(writer, shard_bad, resumed, split, progress_file)
        finally:
            if pool is not None:
                pool.terminate()
            bar.close()
        bad.check(len(items))
        return [{k: v for k, v in s.items() if k != "bad"} for s in writer.shards], bad.found


def _record(
    writer: TarShardWriter, bad: list[list[str]], resumed: dict[str, Any], split: str, progress_file: Path
) -> None:
    """Note the shard just finished (and the bad samples its span held) for a prepare that resumes."""
    writer.shards[-1]["bad"] = bad
    resumed[split] = writer.shards
    write_text_atomic(progress_file, json.dumps(resumed))


def _finished(dest: Path, kind: str) -> dict[str, Any] | None:
    """The manifest of `dest` when it holds `kind` shards and every shard it lists has its size."""
    manifest = SampleShards(dest, kind).manifest
    for split in manifest["splits"].values():
        for s in split["shards"]:
            p = dest / s["file"]
            if not p.is_file() or p.stat().st_size != s["bytes"] or not (dest / s["index"]).is_file():
                return None
    return manifest


# -- reading ---------------------------------------------------------------------------------------------


class SampleShards:
    """A prepared folder of sample shards (`kind`: "speech" or "images"), its manifest read and checked."""

    def __init__(self, root: str | Path, kind: str, key: str = "data.path") -> None:
        """Read `root/manifest.json`; a missing, corrupt or other-kind folder is a DataError naming `key`."""
        self.root, self.key = Path(root).expanduser(), key
        path = self.root / MANIFEST
        redo = f"prepare it again (python -m recipes.prepare ... out={self.root})"
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(
                f"{path} is missing: not a prepared folder, or its prepare did not finish; {redo}",
                key=key,
                value=str(self.root),
                valid=("a folder python -m recipes.prepare wrote",),
            ) from None
        except (OSError, ValueError) as e:
            why = f"{path} is corrupt ({type(e).__name__}: {e}); {redo}"
            raise DataError(why, key=key, value=str(path)) from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("kind") != kind:
            got = manifest.get("kind") if isinstance(manifest, dict) else None
            raise DataError(
                f"{self.root} holds {got or 'no'} sample shards of format {manifest.get('format')!r}, not "
                f"{kind} shards of {FORMAT}; {redo}",
                key=key,
                value=str(self.root),
                valid=(f"{kind} shards",),
            )
        self.manifest = manifest

    def splits(self) -> list[str]:
        """The splits the folder holds."""
        return list(self.manifest["splits"])

    def samples(self, split: str, bad: BadSamples) -> list[Sample]:
        """`split`'s samples, each shard checked against the manifest and its index; samples of a shard cut
        short whose bytes are missing go to `bad` (named, counted) and are left out."""
        if split not in self.manifest["splits"]:
            raise DataError(
                f"{self.root} has no '{split}' split (it has {', '.join(self.splits())}); prepare one",
                key=self.key,
                value=str(self.root),
                valid=tuple(self.splits()),
            )
        out: list[Sample] = []
        for k, s in enumerate(self.manifest["splits"][split]["shards"]):
            out += self._shard_samples(k, s, bad)
        return out

    def _shard_samples(self, k: int, s: dict[str, Any], bad: BadSamples) -> list[Sample]:
        tar, index = self.root / s["file"], self.root / s["index"]
        redo = f"prepare the folder again (python -m recipes.prepare ... out={self.root})"

        def mismatch(why: str) -> DataError:
            valid = ("the manifest's shard",)
            return DataError(f"{tar} {why}; {redo}", key=self.key, value=str(tar), valid=valid)

        if not tar.is_file():
            raise mismatch("is missing")
        size = tar.stat().st_size
        if size > s["bytes"]:
            raise mismatch(f"holds {size} bytes, not the manifest's {s['bytes']}: another prepare's shard")
        try:
            entries = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise mismatch(f"has no readable index {index.name} ({type(e).__name__})") from None
        if not isinstance(entries, list) or len(entries) != s["samples"]:
            raise mismatch(f"has an index {index.name} of another length than the manifest's {s['samples']}")
        with tar.open("rb") as f:
            samples = []
            for n, e in enumerate(entries):
                try:
                    members = {
                        ext: MemberRef(str(tar), int(at), int(n)) for ext, (at, n) in e["members"].items()
                    }
                    facts = {k2: v for k2, v in e.items() if k2 not in ("key", "members")}
                    sample = Sample(str(e["key"]), k, members, facts)
                except (KeyError, TypeError, ValueError) as err:
                    raise mismatch(f"has a malformed index entry {n} in {index.name} ({err})") from None
                end = max(m.offset + m.size for m in members.values())
                if end > size:
                    bad.add(sample.where, f"truncated shard: its bytes end at {end}, the file at {size}")
                    continue
                if n in (0, len(entries) - 1):  # the index names what the tar holds where it says
                    ext, m = next(iter(members.items()))
                    f.seek(m.offset - BLOCK)
                    name = f.read(100).split(b"\0", 1)[0].decode("utf-8", "replace")
                    if name != f"{sample.key}.{ext}":
                        raise mismatch(
                            f"holds {name!r} where its index {index.name} puts {sample.key}.{ext}: the index "
                            "is not this shard's"
                        )
                samples.append(sample)
        return samples
