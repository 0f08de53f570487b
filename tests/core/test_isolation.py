"""`core` is a library: it imports and trains with torch alone (no domains, Hydra or vision/audio libs).

triton is not blocked: torch itself probes it, and blocking it breaks torch rather than testing core.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import REPO, cli_env

BLOCKED = [
    "torchvision",
    "torchaudio",
    "hydra",
    "omegaconf",
    "vision",
    "audio",
    "text",
    "recipes",
    "tqdm",
    "tensorboard",
    "wandb",
    "mlflow",
    "safetensors",
    "sklearn",
    "soundfile",
    "tokenizers",
]


def test_core_works_without_optional_and_domain_packages(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import sys
        BLOCKED = {BLOCKED!r}
        for name in BLOCKED:  # a None entry makes `import name` fail and find_spec report it missing
            sys.modules[name] = None
        import pkgutil, importlib, importlib.util, core
        # the Triton kernel module needs triton by design (it is loaded only when the kernels run)
        no_triton = importlib.util.find_spec("triton") is None
        mods = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")
                if not m.name.endswith("__main__")
                and not (no_triton and m.name == "core.attention.triton_flash")]
        for m in mods:
            importlib.import_module(m)
        from core.loop.trainer import Trainer, TrainerConfig
        from core.optim import OptimConfig
        from tests.core.toy_task import ToyTask
        cfg = TrainerConfig(max_epochs=1, batch_size=8, progress=True)
        out = Trainer(ToyTask(), cfg, OptimConfig(), run_dir=sys.argv[1], device="cpu").fit()
        leaked = sorted(n for n in BLOCKED if sys.modules.get(n) is not None)
        print("OK", len(mods), out["step"], leaked)
    """)
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("OK") and r.stdout.strip().endswith("5.0 []")
    assert (tmp_path / "metrics.jsonl").is_file()
