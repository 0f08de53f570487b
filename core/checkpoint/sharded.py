"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards, a load
reshards to whatever world size and layout (FSDP, TP, DDP, one process) reads it, and the directory protocol
of `core.checkpoint.layout` keeps it atomic.

Layout of `RUN_DIR/checkpoints/step_00001234/` (sharded):
  .metadata        DCP's index: every tensor's global shape and where each of its chunks lies
  __R_0.distcp     rank R's chunks of the model (`model.*` keys) and the optimizer (`optim.*`) state
  train_rankR.pt   rank R's training state (its RNG states differ from other ranks'; scheduler, loop position)
  train.pt         rank 0's training state again, where a single-process reader (`core.checkpoint.load`) looks
  meta.json        written last, by rank 0: step, world size, layout, `"format": "dcp"`; marks it complete

Protocol: rank 0 creates `.tmp-step_X-PID` (PID: rank 0's, so `layout.remove_stale_temporaries` run
on rank 0's host knows when the writer is gone); every rank writes its part; a failure flag is summed over the
ranks, so one rank's failed write makes every rank raise `CheckpointWriteError` instead of leaving the others
at a barrier; rank 0 writes meta.json, fsyncs and renames, and its outcome is summed again (that sum is also
the barrier: no rank returns before the rename). A crash before the rename leaves only the `.tmp-` directory,
which `complete_checkpoints` never lists; call `remove_stale_temporaries` on rank 0 (the host whose pids
name the directories) before the ranks first meet. The checkpoint root must be one filesystem all ranks see.

Loading never runs code from the files: in torch 2.14 DCP's `FileSystemReader.read_metadata` unpickles
`.metadata` with plain `pickle.load`, and `DefaultLoadPlanner.load_bytes` reads non-tensor items (the
optimizer's param_groups) with `torch.load(weights_only=False)`. `SafeReader` unpickles `.metadata` with an
allow-list of DCP's own metadata classes, and `SafePlanner` checks every non-tensor item with
`torch.load(weights_only=True)` first. Tensor chunks are already read with `weights_only=True` by DCP.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from core.checkpoint import layout
from core.checkpoint.layout import METADATA, WRITE_FIX, first_line
from core.checkpoint.weights import clean_state_dict
from core.errors import CheckpointError
from core.files import fsync, write_failure


# ---- saving ------------------------------------------------------------------------------------------------
def save(
    ckpt_root: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train: dict,
    meta: dict,
    keep_last: int = 2,
    async_save: bool = False,
    trainable_only: bool = False,
) -> Path | Future[Path]:
    """Write checkpoint `step` from every rank (each calls this) atomically and prune all but the newest
    `keep_last`; returns its path, or with `async_save` a future of it once the tensors are staged in memory
    (wait on it before the next save; a failure raises `CheckpointWriteError` from `result()` on every rank).
    `train` is this rank's training state without the optimizer: tensors and plain containers only.
    `trainable_only`: the frozen parameters (a LoRA run's base) are left out (`_options`)."""
    wait_for_pending_save()
    rank, world = _rank_world()
    group = _checkpoint_group(dedicated=async_save)
    final = layout.step_dir(ckpt_root, step)
    error: BaseException | None = None
    if rank == 0:
        try:
            layout.fresh_temporary(ckpt_root, step)
        except OSError as e:
            error = e
    # one sum tells every rank rank 0's pid (the temporary dir's name) and whether it could create it
    pid, failed = _sum([os.getpid() if rank == 0 else 0, int(error is not None)], group)
    tmp = layout.temporary_dir(ckpt_root, step, pid)
    if failed:
        raise write_failure(final, error or _peer_failed(0), kind="checkpoint ", fix=WRITE_FIX)

    state = _live_state(model, optimizer, _options(trainable_only))
    writer = FileSystemWriter(tmp, sync_files=True)
    written = {**meta, **describe_layout(model, world), "step": step, "torch": torch.__version__}
    finish = _Finisher(tmp, final, written, keep_last, rank, group)
    if not async_save:
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            error = _root_cause(e)
        error = error or _write_train(tmp, rank, train)
        return finish(error)

    global _pending
    try:
        with _single_process_quiet():
            response = dcp.async_save(
                state, storage_writer=writer, process_group=group, no_dist=group is None
            )
        upload = getattr(response, "upload_completion", response)
    except (Exception, CheckpointException) as e:
        upload, error = None, _root_cause(e)
    error = error or _write_train(tmp, rank, train)

    def wait_then_finish() -> Path:
        err = error
        try:
            if upload is not None:
                upload.result()
        except (Exception, CheckpointException) as e:
            err = err or _root_cause(e)
        return finish(err)

    # one worker thread: the finish's collectives on the checkpoint group never overlap another save's
    _pending = _executor().submit(wait_then_finish)
    return _pending


@dataclass
class _Finisher:
    """The end of a save, shared by the blocking and the background path: agree, rename, prune."""

    tmp: Path
    final: Path
    meta: dict
    keep_last: int
    rank: int
    group: Any

    def __call__(self, error: BaseException | None) -> Path:
        """Turn every rank's outcome into one decision; raise `CheckpointWriteError` on all ranks or none."""
        failed_ranks = self._failed_ranks(error)
        if not failed_ranks and self.rank == 0:
            try:  # DCP fsyncs its shards; the commit flushes the index, meta.json and the train files too
                layout.commit(self.tmp, self.final, self.meta)
            except OSError as e:
                error = e
        if not failed_ranks:
            failed_ranks = self._failed_ranks(error if self.rank == 0 else None)
        if failed_ranks:
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            cause = error or _peer_failed(failed_ranks[0])
            raise write_failure(self.final, cause, kind="checkpoint ", fix=WRITE_FIX)
        if self.rank == 0:
            layout.prune(self.final.parent, keep_last=self.keep_last)
        return self.final

    def _failed_ranks(self, error: BaseException | None) -> list[int]:
        world = dist.get_world_size(self.group) if self.group is not None else 1
        flags = [0] * world
        flags[self.rank] = int(error is not None)
        return [r for r, f in enumerate(_sum(flags, self.group)) if f]


def _write_train(tmp: Path, rank: int, train: dict) -> BaseException | None:
    """Write this rank's training state (rank 0's also as `train.pt`); the error, if any, for the vote."""
    try:
        names = [f"train_rank{rank}.pt"] + (["train.pt"] if rank == 0 else [])
        for name in names:
            torch.save(train, tmp / name)
            fsync(tmp / name)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        return e
    return None


def describe_layout(model: nn.Module, world_size: int) -> dict[str, Any]:
    """What meta.json records about how the state was sharded: world size, wrapper and DTensor meshes."""
    meshes: dict[str, dict[str, int]] = {}
    placements: set[str] = set()
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:  # a DTensor: FSDP2 or tensor parallel
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            meshes[",".join(names)] = dict(zip(names, mesh.mesh.shape, strict=True))
            placements.update(str(pl) for pl in p.placements)
    return {
        "format": "dcp",
        "world_size": world_size,
        "wrapper": type(model).__name__,
        "meshes": list(meshes.values()),
        "placements": sorted(placements),
    }


# ---- loading -----------------------------------------------------------------------------------------------
def load(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool = False,
) -> tuple[dict, dict]:
    """Load sharded checkpoint `path` (written at any world size and layout) into `model` and `optimizer`
    on every rank (each calls this, or one process alone); returns (this rank's training state, meta).

    A rank whose own training state was not written (the world size changed) takes rank
    `rank % saved world size`'s: its RNG states then repeat another rank's, so a run resumed at another
    world size is not bit-exact (only one resumed at the same layout is); meta's `rank_state_from` names
    it. `trainable_only`: the frozen parameters are neither read nor required (`_options`)."""
    wait_for_pending_save()
    meta = layout.read_meta(path)
    rank, _ = _rank_world()
    group = _checkpoint_group(dedicated=False)
    read_metadata(path)  # every rank refuses a crafted index itself, before any collective
    options = _options(trainable_only)
    state = _live_state(model, optimizer, options)
    _dcp_load(path, state, group)
    try:
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=options)
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=options,
            )
    except (RuntimeError, KeyError, ValueError) as e:
        raise _mismatch(path, e) from None
    source = rank % int(meta.get("world_size", 1))
    name = f"train_rank{source}.pt"
    train = _torch_load(path, name if (path / name).is_file() else "train.pt")
    return train, {**meta, "rank_state_from": source}


def load_full_state(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor],
    optim_state: dict | None,
    trainable_only: bool = False,
) -> None:
    """Load the full state of a single-process checkpoint (`path`, read by every rank: it is the size of
    one process's model) into a sharded `model` and `optimizer`, each rank keeping its own shards; the
    id-keyed optimizer state is re-keyed by parameter name for DCP's full-state loader. `trainable_only`: the
    checkpoint holds no frozen parameters (`_options`)."""
    wait_for_pending_save()
    full = _options(trainable_only, full_state_dict=True)
    try:
        set_model_state_dict(model, weights, options=full)
        if optimizer is not None and optim_state is not None:
            by_name = _name_optimizer_state(optim_state, get_optimizer_state_dict(model, optimizer))
            set_optimizer_state_dict(model, optimizer, by_name, options=full)
    except (RuntimeError, KeyError, ValueError) as e:
        raise _mismatch(path, e) from None


def _options(trainable_only: bool, **more: Any) -> StateDictOptions:
    """DCP's state-dict options; `trainable_only` leaves the frozen parameters out of what is written and
    read, and lets a model hold ones the checkpoint lacks: a LoRA run's base comes back from model.weights
    (it never trains), so its checkpoints hold the adapters alone, as one process's do."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, **more)


def _live_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, options: StateDictOptions) -> dict:
    """DCP's view of the live model (and optimizer): {"model": ...(, "optim": ...)}."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def read(path: Path) -> tuple[dict, dict, dict]:
    """(full model state, rank 0's training state, meta) of sharded checkpoint `path`, read by this process
    alone; the optimizer stays in the shards (`load` restores it into a live optimizer)."""
    weights = full_state_from_disk(path)
    train = _torch_load(path, "train.pt") if (path / "train.pt").exists() else {}
    return weights, train, layout.read_meta(path)


def _name_optimizer_state(saved: dict, current: dict) -> dict:
    """`saved` (an `optimizer.state_dict()`: params as ids in param order) keyed by the parameter names
    that `current` (DCP's view of the live optimizer, same param order) lists."""
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    sizes = [len(g["params"]) for g in current["param_groups"]]
    if saved_sizes != sizes:
        raise KeyError(f"optimizer param groups of {saved_sizes} parameters saved, the optimizer has {sizes}")
    name_of: dict[int, str] = {}
    for old, new in zip(saved["param_groups"], current["param_groups"], strict=True):
        name_of.update(zip(old["params"], new["params"], strict=True))
    return {
        "state": {name_of[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def full_state_from_disk(path: Path) -> dict[str, torch.Tensor]:
    """The full model state of sharded checkpoint `path`, read by this process alone (no model needed)."""
    index = read_metadata(path)
    state = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in index.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    loaded: dict[str, Any] = {"model": state}
    _dcp_load(path, loaded, None)
    return loaded["model"]


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state as plain CPU tensors on rank 0 (every rank calls this; others get {}), for
    `model.safetensors`; keys carry no `_orig_mod.` or wrapper prefixes."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return clean_state_dict(get_model_state_dict(model, options=options))


def _dcp_load(path: Path, state: dict, group: Any) -> None:
    try:
        with _single_process_quiet():
            dcp.load(
                state,
                storage_reader=SafeReader(path),
                planner=SafePlanner(),
                process_group=group,
                no_dist=group is None,
            )
    except (Exception, CheckpointException) as e:
        cause = _root_cause(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        if isinstance(cause, pickle.UnpicklingError):
            raise _refused(path, "a data file") from None
        if isinstance(cause, (RuntimeError, KeyError, ValueError, AssertionError)):
            raise _mismatch(path, cause) from None
        raise CheckpointError(f"checkpoint {path} is unreadable: {first_line(cause)}") from None


def _torch_load(path: Path, name: str) -> dict:
    try:
        return torch.load(path / name, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing") from None
    except pickle.UnpicklingError:
        raise _refused(path, name) from None
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {first_line(e)}") from None


def _mismatch(path: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} does not match the model (same model= and its settings?): {first_line(err)}",
        key="checkpoint",
        value=str(path),
    )


def _refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: {what} holds objects other than tensors, plain containers and DCP's index; it "
        "was not loaded (torchkiln never unpickles code from a checkpoint)",
        key="checkpoint",
        value=str(path),
    )


# ---- safe reading ------------------------------------------------------------------------------------------
_MD = "torch.distributed.checkpoint.metadata"
#: every global a DCP `.metadata` pickle names (torch 2.3-2.14): DCP's own dataclasses and enums, torch.Size,
#: dtypes and layouts by name, and the checkpoint's path object; calling any of them runs no foreign code
_INDEX_GLOBALS = {
    *(
        (_MD, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 defines it
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index; any other global (os.system, builtins.eval, ...) is refused unresolved."""

    def find_class(self, module: str, name: str) -> Any:
        """Resolve `module.name` only if it is on the allow-list or a torch dtype."""
        dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _INDEX_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def read_metadata(path: Path, rank: int | None = None) -> Metadata:
    """DCP's index of checkpoint `path`, unpickled with an allow-list; a crafted one is a CheckpointError."""
    index = path / (METADATA if rank is None else f"__{rank}{METADATA}")
    try:
        with index.open("rb") as f:
            md = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {index.name} is missing") from None
    except (pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError, EOFError):
        raise _refused(path, index.name) from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise _refused(path, index.name)
    for info in md.storage_data.values():  # chunks are read from files beside the index, nowhere else
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel:
            raise CheckpointError(
                f"checkpoint {path}: its index points outside the checkpoint ({rel!r})",
                key="checkpoint",
                value=str(rel),
                valid=("a file name beside the index",),
            )
    for md_item in md.state_dict_metadata.values():
        if not isinstance(md_item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise _refused(path, index.name)
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader with the index unpickled through an allow-list (`read_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index, refused in one line (`CheckpointError`) if it names anything but DCP's classes."""
        md = read_metadata(Path(self.path), kwargs.get("rank"))
        if md.storage_meta is not None:
            md.storage_meta.load_id = self.load_id  # what the stock reader does, so DCP's bookkeeping matches
        return md


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items must pass `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Check the item with the weights-only unpickler, then hand the same bytes to the default path."""
        torch.load(value, weights_only=True)  # raises UnpicklingError for anything that could run code
        value.seek(0)
        super().load_bytes(read_item, value)


# ---- process-group plumbing --------------------------------------------------------------------------------
_groups: dict[int, Any] = {}
_pending: Future[Path] | None = None
_pool: ThreadPoolExecutor | None = None


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _checkpoint_group(dedicated: bool = True) -> Any:
    """The group for the checkpoint's own collectives (None without a process group): CPU flags need gloo.
    A gloo default group serves unless `dedicated` (an async save's background collectives must not
    interleave with the training step's on the default group); otherwise a gloo group over all ranks,
    created once per default group, by all ranks together. Reusing the default group where it will do also
    spares a group creation in workers that torchrun restarted, which was seen to fail connecting to the
    dead workers' addresses (tests/core/test_distributed.py, the killed-rank test)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not dedicated and dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that a save or load without a process group is a single process's: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sum(values: list[int], group: Any) -> list[int]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchkiln-ckpt")
    return _pool


def wait_for_pending_save() -> None:
    """Let a running async save finish first (its result stays with the caller's future)."""
    if _pending is not None:
        _pending.exception()


def _root_cause(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException, else `err`."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _peer_failed(rank: int) -> RuntimeError:
    return RuntimeError(f"rank {rank} could not write its part (its log has the cause)")
