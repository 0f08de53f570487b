"""torchvision's ImageFolder with the run's bad-sample policy: unreadable files found by their header when the
tree is read, a file that fails to decode when it is loaded replaced by the next good one. A module of its
own so that `vision.datasets` registers data=imagefolder without importing torchvision (its subclass needs
ImageFolder when defined; vision.models._torchvision_archs says why the import waits)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchvision.datasets import ImageFolder

from core.data.bad_samples import BadSamplePolicy, BadSamples
from vision.datasets import DECODE_ERRORS, _header_problem


class CheckedImageFolder(ImageFolder):
    """torchvision's ImageFolder with its unreadable files left out and any file that fails to decode when
    loaded replaced by the next good one, per the run's bad-sample policy."""

    def __init__(self, root: Path, transform: Callable, policy: BadSamplePolicy, split: str) -> None:
        """Read the tree under `root` and check each file's header."""
        super().__init__(str(root), transform=transform)
        self.bad = BadSamples(policy, f"split '{split}'", "images")
        total = len(self.samples)
        for path, _ in self.samples:
            problem = _header_problem(path)
            if problem:
                self.bad.add(path, problem)
        bad = {p for p, _ in self.bad.found}
        self.samples = [s for s in self.samples if s[0] not in bad]
        self.imgs, self.targets = self.samples, [t for _, t in self.samples]
        self.bad.check(total)

    def describe(self, i: int) -> str:
        """The file of sample `i`."""
        return self.samples[i][0]

    def __getitem__(self, i: int) -> Any:
        return self.bad.load(i, super().__getitem__, self.describe, DECODE_ERRORS)
