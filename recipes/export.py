"""`python -m recipes.export ckpt=RUN_DIR|CKPT format=safetensors|torch_export|onnx|hf|peft [out=PATH]`: a
trained model as a file another program runs, checked against the eager model before it is reported. format=hf
(model=llama and its presets) writes a Hugging Face folder, config.json, model.safetensors and the run's
tokenizer (tokenizer.json, tokenizer_config.json with a chat fine-tune's template), that transformers'
AutoModelForCausalLM and AutoTokenizer load; a LoRA run's (trainer.lora.rank > 0) with its adapters merged
into the weights. format=peft writes a LoRA run's adapters alone, adapter_config.json and
adapter_model.safetensors, that peft's PeftModel.from_pretrained loads onto the base model.

The run is loaded with `recipes.cli.runs.load_run` (its config, task and trained weights) on the CPU in fp32.
Its task says what the exported model takes (`Task.export_inputs`: the tensors of the model's forward, or for
ASR the waveforms, the log-mel front end included) and which dims are dynamic: the batch, and the length where
there is one, within the model's real bounds (an LM's context). Each file is loaded back (`torch.export.load`,
an ONNX Runtime session, a fresh model for safetensors) and run on two batches of the run's validation set, of
different batch sizes and lengths; its largest difference from the eager model is printed and kept in
`export.json` beside the file. A model that cannot export, or whose export differs beyond the tolerance, is
refused in one line (exit 2) and leaves no file. Programs the task exports beside the model
(`Task.export_parts`: an ASR model's attention decoder) go next to the file as `model.<part>.pt2|onnx`, each
checked the same way with its own export.json entry; the model's entry lists them under `parts`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import logging
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import default_collate

from core.checkpoint import save_model_weights
from core.errors import CheckpointWriteError, ConfigError, DataError, ExportError
from core.files import write_text_atomic
from core.loop.task import ExportInputs
from core.nn.lora import lora_modules, merge_lora
from recipes.cli.command import command
from recipes.cli.options import ArgumentError, help_text, parse_options
from recipes.cli.runs import Run, load_run

if TYPE_CHECKING:
    from text.tokenizer import Tokenizer

USAGE = (
    "usage: python -m recipes.export ckpt=RUN_DIR|CKPT format=safetensors|torch_export|onnx|hf|peft "
    "[out=PATH]"
)
#: format -> the file it writes (in RUN_DIR/export/ unless out= says otherwise); hf, peft: a folder
FORMATS = {
    "safetensors": "model.safetensors",
    "torch_export": "model.pt2",
    "onnx": "model.onnx",
    "hf": "hf",
    "peft": "adapter",
}
#: the formats that write a folder (out= names it)
FOLDERS = ("hf", "peft")
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
# fp32 on the CPU. torch_export replays the eager model's ATen ops (its error is 0 in practice); ONNX Runtime
# runs its own kernels (fused LayerNorm and attention, other matmul blockings), and an hf export of a LoRA run
# folds the adapters into the weights, (W + s B A) x for W x + s B (A x): each sums in another order. A
# reduction's rounding scales with the terms it sums, not with its result (~K * 6e-8, fp32's unit roundoff,
# of their magnitude), so a logit near 0 that cancels large terms errs as much as the large logits do: the
# tolerance is relative to the output's largest magnitude, not each element's (an element-wise rtol refused
# a trained LoRA run's merge for one logit near 0: docs/running.md § Export).
# rtol 1e-4 of that scale leaves a margin over 1e-6..1e-5 through a few layers and still catches a wrong op
# (a lost mask, a wrong position moves outputs by 1e-2 or more, far past 1e-4 of logits up to tens); atol
# 1e-5 covers outputs that are all near 0. Integer outputs (frame counts) must match exactly.
RTOL, ATOL = 1e-4, 1e-5
#: validation items in the first example batch (the one the model is exported with); the second has one
EXAMPLE_ITEMS = 4
REPO = Path(__file__).resolve().parent.parent


@dataclass
class ExportConfig:
    """Command-line options (key=value)."""

    #: the training run directory (its model.safetensors), or one of its checkpoints/step_* folders
    ckpt: str = ""
    #: safetensors, torch_export, onnx, hf (a Hugging Face folder; model=llama) or peft (a LoRA run's
    #: adapter folder)
    format: str = ""
    #: the file (or a directory for it; format=hf or peft: the folder); empty: RUN_DIR/export/model.<ext>,
    #: RUN_DIR/export/hf or RUN_DIR/export/adapter
    out: str = ""


def parse_args(argv: list[str]) -> ExportConfig:
    """key=value arguments into an ExportConfig; a missing, unknown or bad one is a one-line ArgumentError."""
    cfg = parse_options(argv, ExportConfig, usage=USAGE, required=("ckpt", "format"))
    if cfg.format not in FORMATS:
        why = f"format={cfg.format} is unknown; valid: {', '.join(FORMATS)}"
        raise ArgumentError(why, key="format", value=cfg.format, valid=FORMATS)
    suffix = Path(FORMATS[cfg.format]).suffix
    if cfg.out and not Path(cfg.out).expanduser().is_dir() and not cfg.out.endswith(suffix):
        # torch.export.load refuses a .pt2 archive by any other name; the others keep the convention
        why = f"out={cfg.out}: a format={cfg.format} file ends in {suffix}, or give a directory"
        raise ArgumentError(why, key="out", value=cfg.out)
    return cfg


def require_packages(fmt: str) -> None:
    """Raise ConfigError naming the pip command when the packages `fmt` needs are missing."""
    if fmt != "onnx":
        return
    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(
            f"format=onnx needs {', '.join(missing)}: pip install 'torchkiln[export]' (-c constraints.txt: "
            "the tested versions)"
        )


def example_inputs(run: Run) -> dict[str, tuple[ExportInputs, ExportInputs]]:
    """Per program ("" the model, then the task's `export_parts`), two examples from the run's validation
    set, through the task's collate and `export_inputs`: the first EXAMPLE_ITEMS items, and the last item
    alone cut to 3/4 of the first's length; different batch sizes and lengths, so the check proves the
    dynamic dims."""
    val = run.task.build_val_dataset()
    if len(val) == 0:
        raise DataError("the run's validation set is empty; export checks the model on its batches")
    collate = run.task.collate_fn() or default_collate
    batches = collate([val[i] for i in range(min(EXAMPLE_ITEMS, len(val)))]), collate([val[len(val) - 1]])
    first = run.task.export_inputs(run.model, batches[0])
    shorter = None if first.length is None else max(1, first.length * 3 // 4)
    second = run.task.export_inputs(run.model, batches[1], length=shorter)
    whole, cut = (
        run.task.export_parts(run.model, batches[0]),
        run.task.export_parts(run.model, batches[1], length=shorter),
    )
    return {"": (first, second)} | {name: (ex, cut[name]) for name, ex in whole.items()}


def part_path(path: Path, part: str) -> Path:
    """Where program `part` of the export at `path` goes: beside it, e.g. model.decoder.pt2."""
    return path.with_name(f"{path.stem}.{part}{path.suffix}") if part else path


def export_safetensors(run: Run, inputs: ExportInputs, path: Path) -> Callable[..., Any]:
    """The run's model weights, as `recipes.train` writes model.safetensors; loaded back into a fresh model
    (strictly: every key, no other) that takes the eager model's place in what is compared."""
    from safetensors.torch import load_model

    save_model_weights(run.model, path)
    fresh = run.task.build_model()
    load_model(fresh, str(path))
    fresh.eval()
    if inputs.module is run.model:
        return fresh
    module = copy.deepcopy(inputs.module)  # e.g. ASR's feature front end around the model
    name = next(n for n, m in inputs.module.named_modules() if m is run.model)
    module.set_submodule(name, fresh)
    return module


def write_torch_export(run: Run, inputs: ExportInputs, path: Path) -> Callable[..., Any]:
    """`torch.export` with the task's dynamic dims, saved as .pt2 and loaded back."""
    try:
        with quiet_exporter():
            program = torch.export.export(inputs.module, inputs.args, dynamic_shapes=inputs.dynamic_shapes)
    except Exception as e:  # the exporter's errors have no common base: any is a refusal
        raise exporter_error(e) from None
    with warnings.catch_warnings():
        # ASR's front-end constants share a storage: the archive warns about weights off the CPU; none are
        warnings.filterwarnings("ignore", message="No complete tensor found")
        torch.export.save(program, path)
        return torch.export.load(path).module()


def write_onnx(run: Run, inputs: ExportInputs, path: Path) -> Callable[..., Any]:
    """The dynamo-based ONNX exporter with the task's dynamic dims; loaded back in ONNX Runtime (CPU)."""
    import onnxruntime

    try:
        with quiet_exporter():
            program = torch.onnx.export(
                inputs.module,
                inputs.args,
                dynamo=True,
                dynamic_shapes=inputs.dynamic_shapes,
                input_names=list(inputs.names),
                output_names=list(inputs.outputs),
                verbose=False,
            )
    except Exception as e:  # as above: the exporter's errors have no common base
        raise exporter_error(e) from None
    program.save(str(path))
    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's errors (e.g. no kernel for an op) share no public base
        raise ExportError(f"ONNX Runtime cannot load it: {first_line(e)}") from None

    def run_session(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feed = {n: a.contiguous().numpy() for n, a in zip(inputs.names, args, strict=True)}
        return tuple(torch.from_numpy(o) for o in session.run(None, feed))

    return run_session


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """Nothing logged or printed while an exporter runs: on a failure torch.export logs its guesses at the
    cause and prints the partial graph (to stderr, whatever the log settings), where the command prints one
    line naming the cause (`exporter_reason`)."""
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def write_hf(run: Run, inputs: ExportInputs, path: Path) -> Callable[..., Any]:
    """A Hugging Face folder of the run's Llama-style model (`text.checkpoints.hf`), read back into a fresh
    model built from the folder alone, which takes the eager model's place in what is compared."""
    from text.checkpoints.hf import write_folder
    from text.llama import Llama
    from text.pretrained import build_llama
    from text.tokenizer import write_hf_tokenizer

    if not isinstance(run.model, Llama):
        raise ExportError(
            f"format=hf writes Llama/Qwen-style decoders (model=llama...), not {type(run.model).__name__}"
        )
    model = run.model
    if lora_modules(model):  # a LoRA run: its adapters folded into the weights (format=peft keeps them apart)
        model = merge_lora(copy.deepcopy(model))
    tok = run.task.tokenizer
    template = getattr(run.task, "template", None)  # a chat fine-tune's: the folder renders prompts as it did
    try:
        path.mkdir(parents=True, exist_ok=True)
        ids = write_hf_tokenizer(
            tok, path, context=model.context, chat_template=None if template is None else template.source
        )
        base = getattr(model, "hf_config", None)
        write_folder(model, path, base_config=(base or {}) | ids if ids else None)
        fresh = build_llama(weights=str(path), context=run.model.context).eval()
        check_tokenizer_folder(tok, path, inputs.args[0][0].tolist())
    except ConfigError as e:
        raise ExportError(str(e)) from None
    return fresh


def check_tokenizer_folder(tok: Tokenizer, path: Path, ids: list[int]) -> None:
    """ExportError unless the tokenizer of the folder at `path`, read as `recipes.generate` reads an HF
    folder, gives `tok`'s ids for the text of `ids` (a validation row) and its end-of-document and
    document-start ids."""
    from text.tokenizer import PretrainedTokenizer

    fresh = PretrainedTokenizer(path)
    text = tok.decode(ids)
    got = (fresh.encode(text), fresh.eos_id, fresh.doc_start_id)
    if got != (tok.encode(text), tok.eos_id, tok.doc_start_id):
        raise ExportError(
            f"the folder's tokenizer.json does not give the run's {tok.name} tokenizer's ids",
            key="tokenizer",
            value=tok.name,
        )


def write_peft(run: Run, inputs: ExportInputs, path: Path) -> Callable[..., Any]:
    """A peft adapter folder of a LoRA run (trainer.lora.rank > 0), read back into a copy of the model whose
    adapters were reset first, which takes the eager model's place in what is compared."""
    from text.checkpoints.hf import load_adapter, write_adapter

    if not lora_modules(run.model) or not hasattr(run.model, "external_name"):
        raise ExportError(
            "format=peft writes the adapters of a LoRA run (trainer.lora.rank > 0, model=llama)"
        )
    weights = run.cfg.get("model", {}).get("weights") or None
    write_adapter(run.model, path, base=weights)
    fresh = copy.deepcopy(run.model)
    for m in lora_modules(fresh).values():
        m.reset_lora()
    load_adapter(fresh, path)
    return fresh


WRITERS = {
    "safetensors": export_safetensors,
    "hf": write_hf,
    "peft": write_peft,
    "torch_export": write_torch_export,
    "onnx": write_onnx,
}


def exporter_error(e: BaseException) -> ExportError:
    """The ExportError for an exporter's failure: its one-line reason, and the op as `key="op"`, `value`
    where the exporter names one."""
    reason = exporter_reason(e)
    op = re.fullmatch(r"ONNX has no function for the op (\S+)|unsupported ops (.+)", reason)
    return ExportError(reason, key="op" if op else None, value=(op.group(1) or op.group(2)) if op else None)


def exporter_reason(e: BaseException) -> str:
    """The first unsupported op or construct an exporter's error names, in one line."""
    chain: list[BaseException] = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    text = "\n".join(str(x) for x in chain)
    m = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>", text)
    if m:
        return f"ONNX has no function for the op {m.group(1)}.{m.group(2)}"
    m = re.search(r"Unsupported FX nodes: (.+)", text)
    if m:
        return f"unsupported ops {m.group(1).strip()}"
    where = _call_site(text)
    if "data-dependent" in text:
        return f"its control flow depends on tensor values ({where or 'data-dependent expression'})"
    m = re.search(r"Not all values of (.+?) satisfy the generated guard (.+)", text)
    if m:
        return f"a dim declared dynamic is not: not all values of {m.group(1)} satisfy {m.group(2).strip()}"
    return first_line(chain[-1]) + (f" ({where})" if where else "")


def first_line(e: BaseException) -> str:
    """`Type: first non-empty line of the message`."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"


def _call_site(text: str) -> str | None:
    """`code` at path:line in function, from the call an exporter's error message quotes."""
    m = re.search(r'call raised this error:\s*\n\s*File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)', text)
    if not m:
        return None
    path = Path(m.group(1))
    with contextlib.suppress(ValueError):
        path = path.relative_to(REPO)
    return f"`{m.group(4).strip()}` at {path}:{m.group(2)} in {m.group(3)}"


def compare(expected: Any, got: Any, names: Sequence[str]) -> float:
    """Largest absolute difference of float outputs; ExportError past the tolerance, on another shape, or on
    any difference of an integer output."""
    expected, got = _as_tuple(expected), _as_tuple(got)
    if len(expected) != len(got):
        raise ExportError(f"the export returns {len(got)} outputs, the eager model {len(expected)}")
    worst = 0.0
    for name, a, b in zip(names, expected, got, strict=True):
        if a.shape != b.shape:
            raise ExportError(f"output {name} has shape {tuple(b.shape)}, the eager model's {tuple(a.shape)}")
        if not a.is_floating_point():
            if not torch.equal(a, b.to(a.dtype)):
                raise ExportError(
                    f"output {name} differs from the eager model's (integers must match)",
                    key="output",
                    value=name,
                    valid=("equal integers",),
                )
            continue
        a, b = a.float(), b.float()
        finite = a.isfinite()
        # an infinite output (a masked logit) must be the same infinity in the export; a NaN never matches
        same_rest = torch.equal(finite, b.isfinite()) and torch.equal(a[~finite], b[~finite])
        err = float((a - b)[finite].abs().max()) if finite.any() else 0.0
        err = err if same_rest else math.inf
        worst = max(worst, err)
        allowed = tolerance(a)
        if not err <= allowed:
            raise ExportError(
                f"output {name} differs from the eager model's by up to {err:.3g}, past {allowed:.3g} "
                f"(atol={ATOL:g} + rtol={RTOL:g} x its largest magnitude)",
                key="output",
                value=name,
                valid=(f"<= {allowed:.3g}",),
            )
    return worst


def tolerance(expected: torch.Tensor) -> float:
    """The largest difference an export may have from the eager model's float output `expected`: ATOL plus
    RTOL times the output's largest finite magnitude."""
    finite = expected.float()[expected.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return ATOL + RTOL * scale


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def describe_dims(inputs: ExportInputs) -> dict[str, list[str | int]]:
    """Each input's shape with its dynamic dims named and bounded: tokens: ["batch>=1", "1<=length<=32"]."""
    out: dict[str, list[str | int]] = {}
    for name, arg, dims in zip(inputs.names, inputs.args, inputs.dynamic_shapes, strict=True):
        shape: list[str | int] = list(arg.shape)
        for i, dim in dims.items():
            hi = dim.max if isinstance(dim.max, int) and dim.max < 2**62 else None
            shape[i] = f"{dim.min}<={dim.__name__}<={hi}" if hi is not None else f"{dim.__name__}>={dim.min}"
        out[name] = shape
    return out


def export(cfg: ExportConfig) -> tuple[Path, dict[str, Any]]:
    """Export the run `cfg.ckpt` names in `cfg.format`, check it, record it; (file, its export.json entry)."""
    require_packages(cfg.format)
    run = load_run(cfg.ckpt, device="cpu", command="recipes.export")
    run.model.float()  # fp32: the tolerance below is fp32's
    path = Path(cfg.out).expanduser() if cfg.out else run.run_dir / "export" / FORMATS[cfg.format]
    if path.is_dir() and cfg.format not in FOLDERS:
        path = path / FORMATS[cfg.format]
    source = run.cfg.get("model", {}).get("weights")
    src, dst = (Path(source).expanduser().resolve(), path.resolve()) if source else (None, None)
    if src is not None and (dst == src or (cfg.format not in FOLDERS and dst.parent == src and dst.exists())):
        # the weights the run was loaded from would be overwritten, or on a failure removed by the clean-up
        raise ExportError(
            f"out={cfg.out} would overwrite what the run was loaded from (model.weights={source}); give "
            "another folder",
            key="out",
            value=cfg.out,
        )
    programs = example_inputs(run)
    if cfg.format in ("safetensors", *FOLDERS):  # one weights file holds every part's weights
        programs = {"": programs[""]}
    written: list[Path] = []
    entries: dict[Path, dict[str, Any]] = {}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for part, examples in programs.items():
            file = part_path(path, part)
            written.append(file)
            entries[file] = _write_checked(run, cfg.format, file, examples)
    except ExportError as e:
        for file in written:
            _remove(file)
        which = f"model={run.cfg['model']['name']} ({run.cfg['task']['name']})"
        raise ExportError(f"{which} cannot be exported as {cfg.format}: {e}") from None
    except OSError as e:
        for file in written:
            _remove(file)
        raise CheckpointWriteError(f"could not write {written[-1]}: {e.strerror or e}") from None
    for file, entry in entries.items():
        record(file, entry)
    entry = entries[path]
    if len(entries) > 1:
        entry["parts"] = {part: part_path(path, part).name for part in programs if part}
        record(path, entry)
    return path, entry


def _remove(path: Path) -> None:
    """Remove what an export left at `path`: a file, or format=hf's folder files."""
    if path.is_dir():
        from text.tokenizer import HF_TOKENIZER_FILES

        folder_files = (
            "config.json",
            "model.safetensors",
            "adapter_config.json",
            "adapter_model.safetensors",
        )
        for name in (*folder_files, *HF_TOKENIZER_FILES):
            (path / name).unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


def _write_checked(
    run: Run, fmt: str, path: Path, examples: tuple[ExportInputs, ExportInputs]
) -> dict[str, Any]:
    """Write one program of the export (from the first example) and check it on both: its export.json
    entry. An ExportError when it cannot be exported or differs beyond the tolerance."""
    first = examples[0]
    loaded = WRITERS[fmt](run, first, path)
    checked = []
    with torch.no_grad():
        for ex in examples:
            shapes = {n: list(a.shape) for n, a in zip(ex.names, ex.args, strict=True)}
            try:
                got = loaded(*ex.args)
            except Exception as e:  # the runtime's own errors (a shape guard, a missing kernel)
                raise ExportError(f"the loaded file fails on inputs {shapes}: {first_line(e)}") from None
            err = compare(ex.module(*ex.args), got, ex.outputs)
            checked.append({"inputs": shapes, "max_abs_error": err})
    return {
        "format": fmt,
        "task": run.cfg["task"]["name"],
        "model": run.cfg["model"]["name"],
        "weights": str(run.weights),
        "inputs": describe_dims(first),
        "outputs": list(first.outputs),
        "preprocessing": first.preprocessing,
        "checked": checked,
        "max_abs_error": max(c["max_abs_error"] for c in checked),
        "rtol": RTOL,
        "atol": ATOL,
        "tolerance": "max abs error <= atol + rtol x the output's largest magnitude",
        "torch": torch.__version__,
    }


def record(path: Path, entry: dict[str, Any]) -> None:
    """Add `entry` under the file's name to `export.json` beside it (one entry per exported file)."""
    index = path.parent / "export.json"
    entries: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        entries = json.loads(index.read_text())
    entries[path.name] = entry
    try:
        write_text_atomic(index, json.dumps(entries, indent=1) + "\n")
    except OSError as e:
        raise CheckpointWriteError(f"could not write {index}: {e.strerror or e}") from None


def run(argv: list[str]) -> int:
    """The command: export, check, and print what the file takes and how close it came."""
    path, entry = export(parse_args(argv))
    shapes = ", ".join("x".join(map(str, next(iter(c["inputs"].values())))) for c in entry["checked"])
    inputs = "; ".join(f"{n} ({', '.join(map(str, s))})" for n, s in entry["inputs"].items())
    print(
        f"exported {path} ({entry['format']}): takes {inputs}; matches the eager model on validation "
        f"batches {shapes}: max abs error {entry['max_abs_error']:.3g} (allowed: atol={ATOL:g} + "
        f"rtol={RTOL:g} x each output's largest magnitude); "
        f"{path.parent / 'export.json'} says what to feed it",
        flush=True,
    )
    return 0


def describe() -> str:
    """`--help`: the keys."""
    doc = __doc__.split("\n\n", 1)[1].strip()
    return help_text(USAGE, doc, [("keys", ExportConfig)])


main = command(run, usage=USAGE, describe=describe)


if __name__ == "__main__":
    sys.exit(main())
