"""text.prepare / recipes.prepare and data=tokens: prepared shards hold exactly the in-memory LM's packed
stream, prepare is idempotent and resumable, and a bad folder or tokenizer is one line naming its key."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from core.data.bad_samples import BadSamplePolicy
from core.data.samplers import ShuffledBatchSampler
from core.errors import ConfigError, DataError
from recipes.prepare import main
from tests.helpers import cli_env, fault
from text import prepare as prep
from text.corpus import in_validation, read_text_documents
from text.lm import LanguageModeling
from text.lm_data import PackedChunks, TokenWindows
from text.token_shards import Shard, ShardSet, ShardWriter, TokenSplit, token_dtype
from text.tokenizer import ByteTokenizer

GPT = {"name": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32}
CONTEXT = 16


def corpus(root: Path, n: int = 12) -> Path:
    """`n` text files of many lengths (some shorter than a window, some spanning several shards)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"{i:02d}.txt").write_text(f"doc {i}: " + "the quick brown fox. " * (1 + i % 5))
    return root


def run_prepare(root: Path, out: Path, **kw: object) -> dict:
    """prepare() at test sizes: small shards (so windows cross them), one process, no progress bar."""
    opts = {"shard_tokens": 64, "val_fraction": 0.0, "workers": 1, "progress": False, **kw}
    return prep.prepare(str(root), str(out), **opts)


def test_windows_of_the_shards_equal_the_in_memory_packed_chunks(tmp_path: Path) -> None:
    root = corpus(tmp_path / "text")
    m = run_prepare(root, tmp_path / "out")
    tok = ByteTokenizer()
    docs = read_text_documents(str(root))  # the in-memory path's documents, in the same (path) order
    want = PackedChunks(tok.encode_batch(docs), CONTEXT, tok.eos_id)
    got = TokenWindows(ShardSet(tmp_path / "out").train, CONTEXT)
    assert len(got) == len(want) > 20 and len(m["splits"]["train"]["shards"]) > 3
    for i in range(len(want)):
        for a, b in zip(got[i], want[i], strict=True):
            assert torch.equal(a, b), i
    # on disk: uint16 shards of shard_tokens tokens (the last shorter), an index per shard, the manifest
    total = sum(len(d.encode()) + 2 for d in docs)
    assert m["splits"]["train"]["tokens"] == total and m["splits"]["train"]["documents"] == len(docs)
    sizes = [(tmp_path / "out" / s["file"]).stat().st_size for s in m["splits"]["train"]["shards"]]
    assert sizes[:-1] == [128] * (len(sizes) - 1) and sum(sizes) == 2 * total
    assert all(
        (tmp_path / "out" / s["file"]).with_suffix(".idx.npy").is_file()
        for s in m["splits"]["train"]["shards"]
    )
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (
        on_disk["dtype"] == "<u2"
        and len(on_disk["sources"]) == 12
        and len(on_disk["sources"][0]["sha256"]) == 64
    )
    assert not (tmp_path / "out" / prep.WORK).exists()
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_ids_past_uint16_round_trip_through_uint32_shards(tmp_path: Path) -> None:
    # a Llama 3-sized vocabulary (128,256 ids): prepare's writer and the reader agree on uint32
    dtype = token_dtype(128_256)
    docs = [np.array([128_000, 5, 70_000, 128_000]), np.array([128_000, 1, 2, 3, 128_000])]
    w = ShardWriter(tmp_path, "train", dtype, 3)
    w.add(np.concatenate(docs).astype(dtype), np.array([len(d) for d in docs]))
    shards = w.close()
    split = TokenSplit(tmp_path, "train", [Shard(**s) for s in shards], dtype, 3)
    split.check()
    assert dtype == np.uint32 and len(shards) == 3 and w.documents == 2
    assert split.read(0, 9).tolist() == np.concatenate(docs).tolist()
    assert split.doc_ids(0, 9).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]


def test_the_lm_task_trains_and_validates_on_held_out_documents_of_the_shards(tmp_path: Path) -> None:
    root = corpus(tmp_path / "text")
    run_prepare(root, tmp_path / "out", val_fraction=0.3)
    task = LanguageModeling(
        model=GPT, data={"name": "tokens", "path": str(tmp_path / "out")}, context=CONTEXT
    )
    train, val = task.build_datasets()
    tok = ByteTokenizer()
    held = [in_validation(f"{i:02d}.txt:0", 0.3) for i in range(12)]
    assert 0 < sum(held) < 12
    docs = read_text_documents(str(root))
    for split, keep in ((train, False), (val, True)):
        want = PackedChunks(
            tok.encode_batch([d for d, h in zip(docs, held, strict=True) if h == keep]), CONTEXT, 257
        )
        assert len(split) == len(want) and all(torch.equal(split[i][0], want[i][0]) for i in range(len(want)))
    assert task.build_model().head.out_features == 258


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 2 workers on a 1-core test slot
def test_any_number_of_loader_workers_gives_the_same_batches(tmp_path: Path) -> None:
    run_prepare(corpus(tmp_path / "text"), tmp_path / "out")
    windows = TokenWindows(ShardSet(tmp_path / "out").train, CONTEXT)

    def stream(workers: int) -> list[torch.Tensor]:
        sampler = ShuffledBatchSampler(len(windows), 4, shuffle=True, seed=7)
        return [b[0] for b in DataLoader(windows, batch_sampler=sampler, num_workers=workers)]

    zero, two = stream(0), stream(2)
    assert len(zero) == len(two) and all(torch.equal(a, b) for a, b in zip(zero, two, strict=True))


def test_a_second_prepare_does_nothing_and_a_changed_file_prepares_again(tmp_path: Path) -> None:
    root = corpus(tmp_path / "text")
    first = run_prepare(root, tmp_path / "out")
    shard = tmp_path / "out" / first["splits"]["train"]["shards"][0]["file"]
    stamp = shard.stat().st_mtime_ns
    again = run_prepare(root, tmp_path / "out")
    assert again["status"] == "up to date" and shard.stat().st_mtime_ns == stamp
    (root / "00.txt").write_text("changed " * 50)
    changed = run_prepare(root, tmp_path / "out")
    assert (
        changed["status"] == "prepared"
        and changed["splits"]["train"]["tokens"] != first["splits"]["train"]["tokens"]
    )


def test_two_prepares_into_one_folder_take_turns(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    root = corpus(tmp_path / "text")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_prepare(root, tmp_path / "out")["status"], range(2)))
    assert sorted(runs) == ["prepared", "up to date"]


def test_a_killed_prepare_tokenizes_only_the_files_it_had_not_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = corpus(tmp_path / "text")
    clean = run_prepare(root, tmp_path / "clean")
    real, seen = prep.tokenize_source, []

    def dies_after_five(job: dict) -> dict:
        if len(seen) == 5:
            raise KeyboardInterrupt  # the kill: five files' work saved, nothing else
        seen.append(job["path"])
        return real(job)

    monkeypatch.setattr(prep, "tokenize_source", dies_after_five)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(root, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    first, seen[:] = list(seen), []
    monkeypatch.setattr(prep, "tokenize_source", lambda job: seen.append(job["path"]) or real(job))
    resumed = run_prepare(root, tmp_path / "out")
    assert len(first) == 5 and sorted(first + seen) == sorted(str(p) for p in root.glob("*.txt"))
    assert resumed["splits"] == clean["splits"]
    for s in clean["splits"]["train"]["shards"]:
        assert (tmp_path / "out" / s["file"]).read_bytes() == (tmp_path / "clean" / s["file"]).read_bytes()


def test_worker_processes_write_the_same_shards_as_one(tmp_path: Path) -> None:
    root = corpus(tmp_path / "text")
    one, two = run_prepare(root, tmp_path / "one"), run_prepare(root, tmp_path / "two", workers=2)
    assert one["splits"] == two["splits"]
    for s in one["splits"]["train"]["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "two" / s["file"]).read_bytes()


def test_bad_documents_are_named_and_counted_under_the_policy(tmp_path: Path) -> None:
    root = corpus(tmp_path / "text", n=6)
    (root / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    (root / "rows.jsonl").write_text('{"text": "a good row"}\n{"text": ""}\nnot json\n{"text": "another"}\n')
    m = run_prepare(root, tmp_path / "out", policy=BadSamplePolicy(max_bad_fraction=0.5))
    where = {b["where"] for b in m["bad_documents"]}
    assert where == {str(root / "bad.txt"), f"{root / 'rows.jsonl'}:2", f"{root / 'rows.jsonl'}:3"}
    assert m["splits"]["train"]["documents"] == 6 + 2
    with pytest.raises(DataError) as e:
        run_prepare(root, tmp_path / "strict", policy=BadSamplePolicy(on_bad_sample="error"))
    assert fault(e.value)[:2] == ("sample", str(root / "bad.txt"))


def test_parquet_rows_prepare_as_the_same_rows_of_jsonl_and_damage_is_counted(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "in the beginning " * (1 + i % 4) for i in range(9)]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "parquet").mkdir()
    table = pa.table({"id": list(range(9)), "text": texts})
    pq.write_table(table, tmp_path / "parquet" / "t.parquet", row_group_size=4)  # rows across 3 groups
    a, b = run_prepare(tmp_path / "jsonl", tmp_path / "a"), run_prepare(tmp_path / "parquet", tmp_path / "b")
    assert a["splits"]["train"]["tokens"] == b["splits"]["train"]["tokens"] > 9 * 20
    x, y = (ShardSet(tmp_path / d).train for d in ("a", "b"))
    assert np.array_equal(x.read(0, x.tokens), y.read(0, y.tokens))
    assert np.array_equal(x.doc_ids(0, x.tokens), y.doc_ids(0, y.tokens))
    # a file that is not parquet and a table without a text column: named and counted, the rest prepared
    (tmp_path / "parquet" / "bad.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.table({"body": texts[:2]}), tmp_path / "parquet" / "no_text.parquet")
    m = run_prepare(tmp_path / "parquet", tmp_path / "c", policy=BadSamplePolicy(max_bad_fraction=0.5))
    assert {d["where"] for d in m["bad_documents"]} == {
        f"{tmp_path / 'parquet' / 'bad.parquet'}:0",
        f"{tmp_path / 'parquet' / 'no_text.parquet'}:0",
    }
    assert m["splits"]["train"]["tokens"] == a["splits"]["train"]["tokens"]


def test_parquet_without_pyarrow_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as where the parquet extra is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    root = corpus(tmp_path / "text", n=2)
    (root / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError) as e:
        run_prepare(root, tmp_path / "out")
    assert fault(e.value) == ("data.root", str(root / "t.parquet"), ("the parquet extra",))


def test_a_missing_corrupt_or_mismatched_prepared_folder_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        ShardSet(tmp_path)
    assert fault(e.value)[:2] == ("data.path", str(tmp_path))
    m = run_prepare(corpus(tmp_path / "text"), tmp_path / "out", val_fraction=0.3)
    data = {"name": "tokens", "path": str(tmp_path / "out")}
    with pytest.raises(ConfigError) as e:
        LanguageModeling(model=GPT, data=data, tokenizer="bpe", context=CONTEXT).build_datasets()
    assert fault(e.value) == ("tokenizer", "bpe", ("bytes",))
    shard = tmp_path / "out" / m["splits"]["train"]["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])  # a truncated shard
    with pytest.raises(DataError) as e:
        ShardSet(tmp_path / "out")
    assert fault(e.value)[:2] == ("shard", str(shard))
    (tmp_path / "out" / "manifest.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        ShardSet(tmp_path / "out")
    assert fault(e.value)[:2] == ("manifest", str(tmp_path / "out" / "manifest.json"))


def test_the_command_prepares_in_process_and_refuses_bad_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = corpus(tmp_path / "text", n=4)
    args = ["+task=lm", f"data.root={root}", f"out={tmp_path / 'out'}", "data.val_fraction=0.5", "workers=1"]
    args.append("progress=false")
    assert main(args) == 0 and (tmp_path / "out" / "manifest.json").is_file()
    assert main(args) == 0  # up to date
    assert main([*args[:-2], "workers=-1"]) == 2
    assert main(["+task=asr", *args[1:]]) == 2
    assert main(args[:2]) == 2  # no out=
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert (
        main(["--help"]) == 0 and "data.root" in capsys.readouterr().out
    )  # the keys as the command spells them


def test_a_prepared_set_without_validation_documents_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # 3 documents at the default data.val_fraction (0.01): by the hash of their names none is held out, so a
    # run of these shards alone would refuse them; the command says so, with exit 2, not "train with ..."
    root = corpus(tmp_path / "text", n=3)
    assert not any(in_validation(f"{i:02d}.txt:0", 0.01) for i in range(3))
    args = ["+task=lm", f"data.root={root}", "workers=1", "progress=false"]
    assert main([*args, f"out={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.val_fraction=0.01" in err[0] and "data.val_path" in err[0]
    assert ShardSet(tmp_path / "a").manifest["splits"]["train"]["documents"] == 3  # written, and usable
    # data.val_fraction=0 asks for no validation split: prepared, and the command names data.val_path
    with caplog.at_level(logging.INFO):
        assert main([*args, f"out={tmp_path / 'b'}", "data.val_fraction=0"]) == 0
    said = (capsys.readouterr().out + caplog.text).strip().splitlines()  # say() prints or logs
    assert "data.val_path=" in said[-1]


def test_the_command_exits_2_with_one_line_in_a_process(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.prepare",
            "+task=lm",
            f"data.root={tmp_path / 'none'}",
            f"out={tmp_path}",
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_resumed_run_on_shards_ends_bit_exact(tmp_path: Path) -> None:
    from tests.helpers import toy_trainer

    run_prepare(corpus(tmp_path / "text"), tmp_path / "out", val_fraction=0.3)
    data = {"name": "tokens", "path": str(tmp_path / "out")}

    def fit(run: Path, **kw: object) -> object:
        task = LanguageModeling(model=GPT, data=data, context=CONTEXT, val_chunks=4)
        t = toy_trainer(run, task=task, max_steps=4, ckpt_every=2, keep_last=10, eval_every=100, **kw)
        t.fit()
        return t

    straight = fit(tmp_path / "a")
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    ckpt = "step_00000002"
    shutil.copytree(tmp_path / "a" / "checkpoints" / ckpt, tmp_path / "b" / "checkpoints" / ckpt)
    resumed = fit(tmp_path / "b", resume="auto")
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_sources_mix_by_token_share_with_each_share_reported_beside_its_target(tmp_path: Path) -> None:
    run_prepare(corpus(tmp_path / "a", n=12), tmp_path / "A", val_fraction=0.3)
    run_prepare(corpus(tmp_path / "b", n=4), tmp_path / "B", val_fraction=0.3)
    sources = [{"path": str(tmp_path / "A"), "weight": 1}, {"path": str(tmp_path / "B"), "weight": 3}]
    task = LanguageModeling(model=GPT, data={"name": "tokens", "sources": sources}, context=CONTEXT)
    train, _ = task.build_datasets()
    alone = [TokenWindows(ShardSet(tmp_path / p).train, CONTEXT) for p in "AB"]
    assert len(train) == sum(len(w) for w in alone) and len(alone[1]) < len(train) * 0.75  # B up-weighted
    shares = train.shares()
    assert abs(shares[0] - 0.25) <= 1 / len(train) and abs(shares[1] - 0.75) <= 1 / len(train)
    own = [{w[j][0].numpy().tobytes() for j in range(len(w))} for w in alone]
    for i in range(len(train)):  # every item is a window of the source it is tagged with
        x, _, _, s = train[i]
        assert x.numpy().tobytes() in own[int(s)], i
    sampler = ShuffledBatchSampler(len(train), 8, shuffle=True, seed=1)
    batch = next(iter(DataLoader(train, batch_sampler=sampler)))
    out = task.step(task.build_model(), batch)
    share = float((batch[3] == 1).float().mean())
    assert float(out.metrics["share/B"]) == share and out.metrics["share_target/B"] == 0.75
    # A is down-weighted (12 files' windows fill a quarter): each slot draws from its own stratum of A by
    # the per-sample seed, so another epoch's seed reads other windows, and the same seed the same ones
    slots = range(train.counts[0])

    def drawn(seed: int) -> list[bytes]:
        out = []
        for i in slots:
            torch.manual_seed(seed * 100_000 + i)
            out.append(train[i][0].numpy().tobytes())
        return out

    first, again, other = drawn(0), drawn(0), drawn(1)
    where: dict[bytes, set[int]] = {}  # the corpus repeats itself: a window's bytes may sit at several j
    for j, w in enumerate(alone[0]):
        where.setdefault(w[0].numpy().tobytes(), set()).add(j)
    n, c = len(alone[0]), train.counts[0]
    assert first == again and first != other and c < n
    for k, (a, b) in enumerate(zip(first, other, strict=True)):
        stratum = set(range(k * n // c, (k + 1) * n // c))
        assert where[a] & stratum and where[b] & stratum, k
    bad = [sources[0], {"path": str(tmp_path / "B"), "weight": 0}]
    with pytest.raises(ConfigError) as e:
        LanguageModeling(model=GPT, data={"name": "tokens", "sources": bad}, context=CONTEXT).build_datasets()
    assert fault(e.value) == ("data.sources[1].weight", "0", ("> 0",))


# -- slow: real processes ----------------------------------------------------------------------------------


def big_corpus(root: Path, files: int, mib: float) -> Path:
    """`files` text files of about `mib` MiB each, of varied lines (seeded: the same bytes every run)."""
    import random

    rng = random.Random(0)
    words = ["the", "lord", "said", "unto", "moses", "and", "it", "came", "to", "pass", "in", "those", "days"]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        line = " ".join(rng.choice(words) for _ in range(4000)) + "\n"
        (root / f"{i:03d}.txt").write_text(line * max(1, int(mib * 2**20 / len(line))))
    return root


@pytest.mark.slow
def test_prepare_killed_with_sigkill_resumes_to_the_same_shards(tmp_path: Path) -> None:
    import os
    import signal
    import time

    root = big_corpus(tmp_path / "text", files=40, mib=2)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "recipes.prepare",
        "+task=lm",
        f"data.root={root}",
        f"out={out}",
        "workers=1",
    ]
    proc = subprocess.Popen([*cmd, "progress=false"], env=cli_env(), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (
        len(list((out / prep.WORK).glob("*.npz"))) < 3 and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "manifest.json").exists()
    kept = len(list((out / prep.WORK).glob("*.npz")))
    assert 3 <= kept < 40
    resumed = prep.prepare(str(root), str(out), workers=1, progress=False)
    clean = prep.prepare(str(root), str(tmp_path / "clean"), workers=1, progress=False)
    assert resumed["splits"] == clean["splits"] and resumed["sources"] == clean["sources"]
    for split in clean["splits"].values():
        for s in split["shards"]:
            assert (out / s["file"]).read_bytes() == (tmp_path / "clean" / s["file"]).read_bytes()


LM_RUN = [
    "+task=lm",
    "data=tokens",
    "trainer=smoke",
    "logger=none",
    "precision=fp32",
    "compile.policy=off",
    "task.context=32",
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "trainer.batch_size=8",
]


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True], ids=["one_source", "mixture"])
def test_two_gloo_ranks_train_on_the_global_batches_of_one_process(tmp_path: Path, mixed: bool) -> None:
    from tests.helpers import dist_env_vars, read_metrics

    run_prepare(corpus(tmp_path / "text", n=40), tmp_path / "out", val_fraction=0.2, shard_tokens=256)
    data = [f"data.path={tmp_path / 'out'}"]
    if mixed:  # a down-weighted source draws its windows by the sample's seed: ranks must draw the same
        run_prepare(corpus(tmp_path / "text2", n=10), tmp_path / "out2", val_fraction=0.2, shard_tokens=256)
        data = [
            f"data.sources=[{{path:{tmp_path / 'out'},weight:0.3}},{{path:{tmp_path / 'out2'},weight:0.7}}]"
        ]
    losses = {}
    for n in (1, 2):
        run = tmp_path / f"run{n}"
        extra = [f"dist.nproc_per_node={n}", "trainer.parallel=ddp"] if n > 1 else []
        cmd = [sys.executable, "-m", "recipes.train", *LM_RUN, *data, *extra]
        r = subprocess.run(
            [*cmd, f"hydra.run.dir={run}"], env=dist_env_vars(), capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stderr[-3000:]
        losses[n] = [row["train/loss"] for row in read_metrics(run) if "train/loss" in row]
    assert len(losses[1]) == 5
    # the same global batches: the same losses step by step (fp32, summed over ranks in another order)
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_run_trains_from_more_tokens_than_its_memory_cap(tmp_path: Path) -> None:
    # a cgroup v1 memory limit of 1.5 GiB around a run whose training split is 2 GiB of uint16 tokens (the
    # in-memory path would hold them as int64 tensors: 8 GiB); the shards are written straight from numpy
    cg = Path("/sys/fs/cgroup/memory") / f"torchkiln_test_{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"no memory cgroup can be made here ({e.strerror}): needs root and cgroup v1 memory")
    try:
        (cg / "memory.limit_in_bytes").write_text(str(3 * 2**29))
        (cg / "memory.memsw.limit_in_bytes").write_text(str(3 * 2**29))
        out = synthetic_shards(tmp_path / "out", train_tokens=2**30, val_tokens=2**20)
        # 2^30 tokens in windows of 33: 32.5M windows, ordered by PermutedBatchSampler with nothing per window
        cmd = [sys.executable, "-m", "recipes.train", *LM_RUN, f"data.path={out}"]
        shell = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
        r = subprocess.run(
            ["sh", "-c", shell, "sh", *cmd, "task.val_chunks=64", f"hydra.run.dir={tmp_path / 'run'}"],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]  # not killed by the cap
        from tests.helpers import read_metrics

        assert [row["step"] for row in read_metrics(tmp_path / "run") if "train/loss" in row] == [
            1,
            2,
            3,
            4,
            5,
        ]
        print(
            "peak memory of the run's cgroup, MiB:", int((cg / "memory.max_usage_in_bytes").read_text()) >> 20
        )
    finally:
        cg.rmdir()


def synthetic_shards(out: Path, *, train_tokens: int, val_tokens: int) -> Path:
    """A prepared folder of random byte-tokenizer ids in documents of 4096 tokens, written by prepare's own
    ShardWriter a chunk at a time (never the whole corpus in memory)."""
    from text.tokenizer import tokenizer_hash

    out.mkdir(parents=True)
    tok, doc, chunk = ByteTokenizer(), 4096, 2**24
    rng = np.random.default_rng(0)
    splits = {}
    for split, total in (("train", train_tokens), ("val", val_tokens)):
        w = ShardWriter(out, split, np.dtype("<u2"), 1 << 26)
        for _ in range(total // chunk if total >= chunk else 1):
            n = min(chunk, total)
            tokens = rng.integers(0, 256, n, dtype=np.uint16)
            tokens[::doc] = tok.eos_id
            w.add(tokens, np.full(n // doc, doc, dtype=np.int64))
        shards = w.close()
        splits[split] = {"tokens": w.written, "documents": w.documents, "shards": shards}
    manifest = {
        "format": "torchkiln.tokens/1",
        "tokenizer": {"name": "bytes", "hash": tokenizer_hash(tok), "vocab_size": 258, "eos_id": tok.eos_id},
        "dtype": "<u2",
        "shard_tokens": 1 << 26,
        "splits": splits,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("n", [1, 5, 37, 300])
def test_the_permuted_sampler_orders_each_epoch_as_a_seeded_permutation(n: int) -> None:
    from core.data.samplers import PermutedBatchSampler

    def sampler(seed: int = 4, **kw: bool) -> PermutedBatchSampler:
        return PermutedBatchSampler(n, 8, shuffle=True, seed=seed, **kw)

    epochs = [[i for b in sampler().batches(e) for i in b] for e in (0, 1)]
    assert all(sorted(order) == list(range(n)) for order in epochs)  # each epoch: every item once
    assert (epochs[0] != epochs[1]) == (n > 1) and [i for b in sampler().batches(0) for i in b] == epochs[0]
    assert (epochs[0] != [i for b in sampler(seed=5).batches(0) for i in b]) == (n > 1)
    batches = sampler().batches(0)
    assert list(batches[1:]) == list(batches)[1:] and batches[-1] == list(batches)[-1]
    filled = sampler()
    filled.set_fill_last(True)
    got = list(filled.batches(0))
    assert got[:-1] == list(batches)[:-1] and all(len(b) == 8 for b in got)
    tail = epochs[0][(len(got) - 1) * 8 :]
    assert got[-1] == (tail + epochs[0] * 8)[:8]  # a short last batch topped up from the epoch's start
    assert len(sampler(drop_last=True).batches(0)) == n // 8
    huge = PermutedBatchSampler(10**12, 8, shuffle=True, seed=0)  # nothing is held per item
    first = huge.batches(3)[0]
    assert len(set(first)) == 8 and all(0 <= i < 10**12 for i in first)


def test_bpe_and_pretrained_tokenizers_prepare_and_are_checked_against_the_manifest(tmp_path: Path) -> None:
    from text.lm_data import TokenCorpus, tokens
    from text.tokenizer import TokenizerSpec

    root = corpus(tmp_path / "text")
    run_prepare(root, tmp_path / "bpe", val_fraction=0.3, tokenizer=prep.TokenizerChoice("bpe", 300))
    data = {"name": "tokens", "path": str(tmp_path / "bpe")}
    task = LanguageModeling(model=GPT, data=data, tokenizer="bpe", bpe_vocab_size=300, context=CONTEXT)
    train, _ = task.build_datasets()
    tok = task.tokenizer
    first = read_text_documents(str(root))[0]
    vocab = ShardSet(tmp_path / "bpe").tokenizer["vocab_size"]  # a tiny corpus learns fewer than 300
    assert 258 < tok.vocab_size == vocab <= 300 and train[0][0][0] == tok.eos_id
    assert tok.decode(train[0][0].tolist()).startswith(first[:8])  # the shards hold bpe ids of the text
    with pytest.raises(ConfigError) as e:
        LanguageModeling(model=GPT, data=data, tokenizer="bpe", bpe_vocab_size=400).build_datasets()
    assert fault(e.value) == ("task.bpe_vocab_size", "400", ("300",))
    # the same rules as a Hugging Face folder's tokenizer.json: tokenizer=pretrained prepares and checks
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": tok.eos_id}))
    choice = prep.TokenizerChoice("pretrained", folder=str(folder))
    run_prepare(root, tmp_path / "hf_out", val_fraction=0.3, tokenizer=choice)
    shards: TokenCorpus = tokens(path=str(tmp_path / "hf_out"))
    assert shards.tokenizer(TokenizerSpec("pretrained", 0, str(folder))).vocab_size == vocab
    a, b = ShardSet(tmp_path / "bpe").train, ShardSet(tmp_path / "hf_out").train
    assert a.tokens == b.tokens and np.array_equal(a.read(0, a.tokens), b.read(0, b.tokens))
    with pytest.raises(ConfigError) as e:
        shards.tokenizer(TokenizerSpec("bytes", 0))
    assert fault(e.value) == ("tokenizer", "bytes", ("pretrained",))


@pytest.mark.slow
def test_a_run_saved_at_two_ranks_resumes_at_one_and_back_with_the_same_remaining_batches(
    tmp_path: Path,
) -> None:
    from tests.helpers import dist_env_vars, read_metrics

    run_prepare(corpus(tmp_path / "text", n=40), tmp_path / "out", val_fraction=0.2, shard_tokens=256)
    args = [*LM_RUN, f"data.path={tmp_path / 'out'}", "trainer.parallel=ddp", "trainer.max_steps=8"]
    args += ["trainer.ckpt_every=2", "trainer.keep_last=10"]

    def train(run: str, ranks: int, *extra: str) -> dict[int, float]:
        cmd = [sys.executable, "-m", "recipes.train", *args, f"dist.nproc_per_node={ranks}", *extra]
        r = subprocess.run(
            [*cmd, f"hydra.run.dir={tmp_path / run}"],
            env=dist_env_vars(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return {row["step"]: row["train/loss"] for row in read_metrics(tmp_path / run) if "train/loss" in row}

    # saved at 2 ranks, resumed at 1; that run's own checkpoint resumed at 2 again
    straight = train("straight", 2)
    at_one = train("at_one", 1, f"resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000004'}")
    back = train("back", 2, f"resume={tmp_path / 'at_one' / 'checkpoints' / 'step_00000006'}")
    assert (sorted(at_one), sorted(back)) == ([5, 6, 7, 8], [7, 8])
    # the same global batches after each checkpoint: the same losses (fp32, summed in another order)
    for rest in (at_one, back):
        torch.testing.assert_close([rest[s] for s in rest], [straight[s] for s in rest], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_run_on_shards_killed_with_sigkill_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    from tests.helpers import dist_env_vars, killed_and_resumed

    run_prepare(corpus(tmp_path / "text", n=40), tmp_path / "out", val_fraction=0.2, shard_tokens=256)
    steps = ["trainer.max_steps=30", "trainer.ckpt_every=2", "trainer.keep_last=20", "trainer.export=last"]
    cmd = [sys.executable, "-m", "recipes.train", *LM_RUN, f"data.path={tmp_path / 'out'}", *steps]
    killed_and_resumed(cmd, tmp_path, 4, dist_env_vars())
