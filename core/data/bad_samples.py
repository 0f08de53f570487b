"""Bad samples: one per-run policy and one collector that every domain's reader feeds.

A corrupt image, a truncated clip or a broken table row is skipped and named (path, row, reason), or stops
the run in one line, the same way in every domain. Readers check what is cheap while a split is built
(headers, sizes, table rows), call `BadSamples.add` for each bad sample, then `BadSamples.check(total)`.
What shows only when a sample is decoded (a truncated JPEG, a silent clip) is caught at load time by
`BadSamples.load`: under `skip` it returns the next good sample in index order instead, so which sample a
batch holds stays a function of (seed, epoch) and resumed runs stay bit-exact.

The config spells the policy's fields flat in each data section (`data.on_bad_sample`,
`data.max_bad_fraction`): a builder takes `policy: BadSamplePolicy = DEFAULT_POLICY` and the registry
gathers the keys into it, so the defaults live here only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

import torch

from core.bounds import Bounds, check_values
from core.errors import DataError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: data.on_bad_sample values: skip the sample (named in the log, counted as data/bad_samples) or stop
ON_BAD_SAMPLE = ("skip", "error")


@dataclass(frozen=True)
class BadSamplePolicy:
    """What a run does with samples it cannot use (config: `data.on_bad_sample`, `data.max_bad_fraction`)."""

    #: "skip": leave the sample out, name it in the log and count it; "error": stop at the first one
    on_bad_sample: Annotated[str, Bounds(choices=ON_BAD_SAMPLE)] = "skip"
    #: largest fraction of a split that may be skipped before the run stops
    max_bad_fraction: Annotated[float, Bounds(ge=0, lt=1)] = 0.01

    def __post_init__(self) -> None:
        check_values("data", dataclasses.asdict(self), BadSamplePolicy)


#: the policy a builder gets when the config does not set one (a frozen instance: safe as a default)
DEFAULT_POLICY = BadSamplePolicy()


class BadSample(Exception):
    """Raised by a sample reader for a sample it cannot use; the message is the reason (e.g. "silent")."""


#: every collector made in this process, oldest first: a run sums those made since it started (`count_since`)
_RECORDED: list[BadSamples] = []


class BadSamples:
    """The bad samples of one source (a split, a file): each named with its reason, judged by the policy."""

    def __init__(self, policy: BadSamplePolicy, source: str, noun: str = "samples") -> None:
        """Collect for `source` (e.g. "split 'train'", a file's path); `noun` names its samples ("rows")."""
        self.policy, self.source, self.noun = policy, source, noun
        self.found: list[tuple[str, str]] = []  # (where, why) found while the split was built
        self.total = 0
        # indices found bad at load time, in shared memory so DataLoader workers' finds reach the run
        self._flags = torch.zeros(0, dtype=torch.uint8)
        _RECORDED.append(self)

    def add(self, where: str, why: str) -> None:
        """Record one bad sample (`where`: its path, or path:row); under `error` stop here."""
        self.found.append((where, why))
        if self.policy.on_bad_sample == "error":
            raise DataError(
                f"{where}: {why} (in {self.source}; data.on_bad_sample=error): fix or remove it, or set "
                "data.on_bad_sample=skip",
                key="sample",
                value=where,
            )

    def check(self, total: int) -> None:
        """After a split's `total` samples were looked at: stop past the policy's fraction, else log the
        skipped ones; the `total - len(found)` kept samples may then be read through `load`."""
        self.total = total
        self._flags = torch.zeros(total - len(self.found), dtype=torch.uint8).share_memory_()
        if not self.found:
            return
        self._judge(len(self.found), self.found[0])
        log.warning("skipped %s", self._summary(len(self.found), self.found[:3]))
        for where, why in self.found[3:]:
            log.info("skipped %s (%s)", where, why)

    def reject(self, found: list[tuple[str, str]]) -> None:
        """After `check` and before any `load`: record samples a later check found bad (one that needs the
        model, say), which the caller then leaves out of the kept ones; judged and logged as `check` does."""
        if int(self._flags.sum()):
            raise RuntimeError("reject() after samples were loaded: the kept indices have moved")
        for where, why in found:
            self.add(where, why)
        self._flags = torch.zeros(self.total - len(self.found), dtype=torch.uint8).share_memory_()
        if not found:
            return
        self._judge(len(self.found), found[0])
        log.warning("skipped %s", self._summary(len(found), found[:3]))
        for where, why in found[3:]:
            log.info("skipped %s (%s)", where, why)

    @property
    def count(self) -> int:
        """Bad samples so far: found while building plus found while loading (in any worker)."""
        return len(self.found) + int(self._flags.sum())

    def load(
        self,
        i: int,
        read: Callable[[int], T],
        where: Callable[[int], str],
        errors: tuple[type[BaseException], ...] = (),
    ) -> T:
        """`read(i)`; if it raises `BadSample` or one of `errors`, record sample i, and under `skip` return
        the next index (in order, wrapping) that reads."""
        n = len(self._flags)
        for j in (k % n for k in range(i, i + n)):
            if self._flags[j]:
                continue
            try:
                return read(j)
            except (BadSample, *errors) as e:
                why = str(e) if isinstance(e, BadSample) else f"{type(e).__name__}: {str(e).splitlines()[0]}"
                self._found_at_load(j, where(j), why)
        raise DataError(f"no sample in {self.source} can be read; check its files")

    def _found_at_load(self, j: int, where: str, why: str) -> None:
        if self.policy.on_bad_sample == "error":
            self.add(where, why)
        self._flags[j] = 1
        self._judge(self.count, (where, why))
        log.warning("skipped %s (%s) in %s; the next sample takes its place", where, why, self.source)

    def _summary(self, n: int, examples: list[tuple[str, str]]) -> str:
        shown = "; ".join(f"{w} ({why})" for w, why in examples)
        return f"{n} of {self.total} {self.noun} in {self.source} are bad, e.g. {shown}"

    def _judge(self, n: int, example: tuple[str, str]) -> None:
        limit = self.policy.max_bad_fraction
        if n > limit * self.total:
            examples = [*self.found[:3]] or [example]
            raise DataError(
                f"{self._summary(n, examples)}; more than data.max_bad_fraction={limit:g}: fix or remove "
                "them, or raise data.max_bad_fraction",
                key="data.max_bad_fraction",
                value=f"{n}/{self.total}",  # the bad samples found, of the source's
                valid=(f"<= {limit:g}",),
            )


def mark() -> int:
    """A position in this process's record of collectors; `count_since(mark())` counts what comes after."""
    return len(_RECORDED)


def count_since(start: int) -> int:
    """Bad samples skipped by the collectors made since `start` (a `mark()`), load-time ones included."""
    return sum(c.count for c in _RECORDED[start:])
