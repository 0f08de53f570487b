"""core.data.sample_shards and ShardWindowBatchSampler: samples round-trip through tar shards any tar reader
reads, prepare is idempotent and survives SIGKILL, an index or shard that does not match is one error, a
shard cut short costs only its damaged samples, and the window sampler is a seeded order of whole shards."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from core.data.bad_samples import BadSamplePolicy, BadSamples
from core.data.sample_shards import SampleShards, prepare_samples, read_member
from core.data.samplers import ShardWindowBatchSampler, ShuffledBatchSampler
from core.errors import DataError
from tests.helpers import cli_env, fault

BAD = 5  # item 5 of each split is bad


def load(item: int) -> tuple[dict[str, bytes], dict[str, object]] | str:
    """A test sample: a payload of 700-1500 bytes seeded by the item, and its facts; item BAD is bad."""
    if item % 100 == BAD:
        return "broken on purpose"
    if os.environ.get("SLOW_LOAD"):
        time.sleep(0.02)
    payload = hashlib.sha256(str(item).encode()).digest() * (22 + item % 25)
    return {"bin": payload, "json": json.dumps({"item": item}).encode()}, {"item": item}


ITEMS = {"train": list(range(60)), "val": list(range(100, 112))}


def prepare(out: Path, **kw: object) -> dict:
    """prepare_samples of ITEMS into 8 KiB shards, one process, no bar."""
    opts = {"kind": "test", "splits": ITEMS, "load": load, "describe": str, "inputs": {"v": 1}}
    lenient = BadSamplePolicy(max_bad_fraction=0.1)
    settings = {"shard_bytes": 8192, "workers": 1, "progress": False, "policy": lenient}
    return prepare_samples(out, **{**opts, **settings, **kw})


def read_all(
    out: Path, split: str = "train", policy: BadSamplePolicy | None = None
) -> tuple[list, BadSamples]:
    """(item, payload) of every readable sample of `split`, and the bad ones found."""
    bad = BadSamples(policy or BadSamplePolicy(max_bad_fraction=0.5), split)
    samples = SampleShards(out, "test").samples(split, bad)
    return [(s.facts["item"], read_member(s.members["bin"])) for s in samples], bad


def test_samples_round_trip_through_shards_that_a_plain_tar_reader_reads(tmp_path: Path) -> None:
    m = prepare(tmp_path / "out")
    got, _ = read_all(tmp_path / "out")
    want = [(i, load(i)[0]["bin"]) for i in ITEMS["train"] if i != BAD]
    assert got == want
    shards = m["splits"]["train"]["shards"]
    assert len(shards) > 3 and m["splits"]["train"]["samples"] == 59
    assert m["bad_samples"] == [
        {"where": "5", "why": "broken on purpose"},
        {"where": "105", "why": "broken on purpose"},
    ]
    names, payloads = [], []
    for s in shards:
        path = tmp_path / "out" / s["file"]
        assert (
            hashlib.sha256(path.read_bytes()).hexdigest() == s["sha256"] and path.stat().st_size == s["bytes"]
        )
        with tarfile.open(path) as tar:  # WebDataset's layout: KEY.EXT members, a sample's members together
            for member in tar:
                names.append(member.name)
                if member.name.endswith(".bin"):
                    payloads.append(tar.extractfile(member).read())  # type: ignore[union-attr]
    assert payloads == [p for _, p in want]
    assert names[:4] == ["000000000.bin", "000000000.json", "000000001.bin", "000000001.json"]


def test_a_second_prepare_does_nothing_and_changed_inputs_prepare_again(tmp_path: Path) -> None:
    first = prepare(tmp_path / "out")
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.tar")}
    again = prepare(tmp_path / "out")
    assert again["status"] == "up to date" and first["status"] == "prepared"
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.tar")}
    other = prepare(tmp_path / "out", inputs={"v": 2}, shard_bytes=1 << 20)
    assert other["status"] == "prepared" and len(other["splits"]["train"]["shards"]) == 1
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["train-00000.tar", "val-00000.tar"]


def test_bad_samples_past_the_policy_stop_prepare_naming_one(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        prepare(tmp_path / "out", policy=BadSamplePolicy("error"))
    assert fault(e.value)[:2] == ("sample", "5")
    with pytest.raises(DataError) as e:
        prepare(tmp_path / "out2", policy=BadSamplePolicy(max_bad_fraction=0.01))
    assert fault(e.value)[0] == "data.max_bad_fraction"


def test_worker_processes_write_the_same_shards_as_one(tmp_path: Path) -> None:
    one, two = prepare(tmp_path / "a"), prepare(tmp_path / "b", workers=2)
    assert one["splits"] == two["splits"]


SCRIPT = """
import sys
from pathlib import Path
from tests.core.test_sample_shards import prepare
prepare(Path(sys.argv[1]))
"""


@pytest.mark.slow  # a process of its own (default suite time)
def test_prepare_killed_with_sigkill_continues_to_the_same_shards(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = cli_env({"SLOW_LOAD": "1"})
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(out)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(out.glob("train-*.tar"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "manifest.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("train-*.tar")}
    assert len(kept) >= 2
    resumed, clean = prepare(out), prepare(tmp_path / "clean")
    assert resumed["splits"] == clean["splits"] and resumed["bad_samples"] == clean["bad_samples"]
    # the shards finished before the kill were kept, not written again
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items() if name != max(kept))
    assert not list(out.glob(".*.partial")) and not (out / ".work").exists()


def test_an_index_or_shard_that_does_not_match_is_one_error_naming_it(tmp_path: Path) -> None:
    prepare(tmp_path / "out")
    out = tmp_path / "out"
    (out / "train-00001.idx.json").write_bytes((out / "train-00002.idx.json").read_bytes())
    with pytest.raises(DataError) as e:
        read_all(out)
    assert fault(e.value)[:2] == ("data.path", str(out / "train-00001.tar"))
    prepare(tmp_path / "out2")
    out = tmp_path / "out2"
    with (out / "train-00000.tar").open("ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(DataError) as e:
        read_all(out)
    assert fault(e.value)[1] == str(out / "train-00000.tar")
    with pytest.raises(DataError) as e:
        SampleShards(out, "speech")
    assert fault(e.value)[0] == "data.path"


def test_a_shard_cut_short_costs_only_its_damaged_samples(tmp_path: Path) -> None:
    m = prepare(tmp_path / "out")
    out = tmp_path / "out"
    shard = m["splits"]["train"]["shards"][1]
    index = json.loads((out / shard["index"]).read_text())
    # cut inside the third sample's payload: it and the samples after it in this shard are lost
    cut = index[2]["members"]["bin"][0] + 10
    os.truncate(out / shard["file"], cut)
    got, bad = read_all(out)
    lost = [e["item"] for e in index[2:]]
    assert [i for i, _ in got] == [i for i in ITEMS["train"] if i != BAD and i not in lost]
    assert len(bad.found) == len(lost) and all("truncated" in why for _, why in bad.found)
    assert all(p == load(i)[0]["bin"] for i, p in got)


def windows(
    n_per_shard: list[int], window: int, shuffle: bool = True, seed: int = 1
) -> ShardWindowBatchSampler:
    shard_of = [k for k, n in enumerate(n_per_shard) for _ in range(n)]

    def make(idx: list[int], s: int) -> ShuffledBatchSampler:
        return ShuffledBatchSampler(len(idx), 4, shuffle=shuffle, seed=s)

    return ShardWindowBatchSampler(shard_of, make, window=window, shuffle=shuffle, seed=seed)


def test_the_window_sampler_reads_each_shard_within_one_window_in_a_seeded_order() -> None:
    sizes = [9, 7, 12, 5, 10, 8, 11]
    shard_of = [k for k, n in enumerate(sizes) for _ in range(n)]
    s = windows(sizes, window=2)
    epoch0, epoch1 = s.batches(0), s.batches(1)
    assert sorted(i for b in epoch0 for i in b) == list(range(sum(sizes)))  # each sample once
    assert epoch0 == windows(sizes, window=2).batches(0) and epoch0 != epoch1  # a function of (seed, epoch)
    # each shard's batches span one stretch of the epoch, and overlapping stretches join at most 2 shards
    spans: dict[int, list[int]] = {}
    for j, b in enumerate(epoch0):
        for k in {shard_of[i] for i in b}:
            spans.setdefault(k, [j, j])[1] = j
    groups: list[tuple[int, set[int]]] = []  # (last batch, shards) of each run of overlapping spans
    for k, (first, last) in sorted(spans.items(), key=lambda kv: kv[1]):
        if groups and first <= groups[-1][0]:
            groups[-1] = (max(last, groups[-1][0]), groups[-1][1] | {k})
        else:
            groups.append((last, {k}))
    assert [len(g) for _, g in groups] == [2, 2, 2, 1]
    # the shard order is shuffled; without shuffling the windows go in shard order, samples in order
    assert [i for b in windows(sizes, window=3, shuffle=False).batches(0) for i in b] == list(
        range(sum(sizes))
    )
    s.set_epoch(1, start=3)
    assert list(s) == epoch1[3:]


def test_the_window_sampler_answers_for_the_whole_sets_buckets() -> None:
    from core.data.samplers import LengthBucketBatchSampler

    lengths = [5 + (i * 7) % 40 for i in range(60)]
    whole = LengthBucketBatchSampler(lengths, 4, shuffle=True, seed=0, num_buckets=4)

    def make(idx: list[int], s: int) -> LengthBucketBatchSampler:
        sub = [lengths[i] for i in idx]
        return LengthBucketBatchSampler(sub, 4, shuffle=True, seed=s, boundaries=whole.boundaries)

    s = ShardWindowBatchSampler(
        [i // 10 for i in range(60)], make, window=2, shuffle=True, seed=0, whole=whole
    )
    assert s.pad_to_bucket is not None and s.boundaries == whole.boundaries
    # each window's batch holds one of the whole set's buckets: a compiled model sees no new padded length
    for b in s.batches(0):
        assert len({whole.padded_length(lengths[i]) for i in b}) == 1
