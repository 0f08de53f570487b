"""`python -m recipes.average ckpt=RUN_DIR last=N [out=FILE]`: the average of a run's newest N checkpoints.

The model weights of the newest N complete checkpoints the run kept (`trainer.keep_last`) are averaged
elementwise (`core.loop.ema.average_checkpoints`: float64 sums, integer buffers the newest's), read with
weights-only loads, and written as safetensors to RUN_DIR/model.safetensors (or `out`), where
`python -m recipes.eval ckpt=RUN_DIR` (and predict, export) read the run's weights. The weights the run
exported there move to RUN_DIR/model.exported.safetensors first (once: a second average keeps the run's
own), so nothing trained is lost. One JSON line on stdout names the checkpoints averaged, the file written
and where the export was kept.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from core.bounds import Bounds
from core.checkpoint import write_safetensors
from core.errors import ConfigError
from core.loop.ema import average_checkpoints, last_checkpoints
from recipes.cli.command import command
from recipes.cli.options import help_text, parse_options

USAGE = "usage: python -m recipes.average ckpt=RUN_DIR last=N [out=FILE]"


@dataclass
class AverageOptions:
    """The command's keys."""

    #: the training run directory whose checkpoints/ are averaged
    ckpt: str = ""
    #: how many of the newest checkpoints to average
    last: Annotated[int, Bounds(ge=1)] = 2
    #: where the averaged weights go (safetensors); empty: RUN_DIR/model.safetensors
    out: str = ""


def run(argv: list[str]) -> int:
    """The command: average, write the file, print one JSON line."""
    opts = parse_options(argv, AverageOptions, usage=USAGE, required=("ckpt",))
    run_dir = Path(opts.ckpt).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"ckpt={opts.ckpt}: no such run directory")
    paths = last_checkpoints(run_dir, opts.last)
    out = Path(opts.out).expanduser() if opts.out else run_dir / "model.safetensors"
    state = average_checkpoints(paths)
    kept = run_dir / "model.exported.safetensors"
    try:
        if out == run_dir / "model.safetensors" and out.is_file() and not kept.exists():
            out.replace(kept)  # the run's own export is kept beside the average
        out.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(state, out)
    except OSError as e:
        why = e.strerror or e
        raise ConfigError(f"out={out}: cannot write it ({why}); choose another out=FILE") from None
    line = {"averaged": [str(p) for p in paths], "written": str(out)}
    if kept.is_file():
        line["export_kept"] = str(kept)
    print(json.dumps(line), flush=True)
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", AverageOptions)])


main = command(run, usage=USAGE, describe=describe)

if __name__ == "__main__":
    sys.exit(main())
