"""EleutherAI's lm-evaluation-harness on a torchkiln decoder: `HarnessLM`, its model interface
(`loglikelihood`, `loglikelihood_rolling`, `generate_until`) over a loaded run's model and tokenizer, and
`evaluate_tasks`, which checks the tasks offline and runs lm-eval's own evaluator.

The only module that imports `lm_eval` (the optional extra `eval`); `recipes.eval` imports it only when a
`harness.*` key is given. The semantics are `lm_eval.models.huggingface.HFLM`'s, so a run and the Hugging Face
folder `recipes.export format=hf` writes of it score the same (tests/text/test_harness.py, 1e-4 per request
in fp32): a text is encoded as that folder's tokenizer encodes it (the document start first, unless the text
already starts with its token), a context and continuation are encoded whole and split, a request longer than
the model's context keeps its last `context + 1` tokens, requests are sorted longest first and scored a batch
per forward (right padding: the model is causal), one-token continuations of one context share a forward,
and `generate_until` stops at the task's `until` strings, the end of text or `max_gen_toks` (256 by default).
Greedy generation decodes a chunk's prompts as one left-padded batch against one KV cache, as HFLM
batches them (`text.generation.greedy_rows`: each row's text is the one it has alone); sampled generation is
`text.generation.stream`'s, a request at a time.

No network: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before `datasets` is imported, and only tasks
whose data is a local file (`dataset_path: json|csv|parquet|text|arrow` with `dataset_kwargs.data_files`
that exist) run; any other task, or an unknown one, is one ConfigError naming it before any model work.
"""

from __future__ import annotations

import os

# datasets and huggingface_hub read these at import: set before lm_eval imports them (no download, ever)
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import contextlib  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from core.device import DevicePlan  # noqa: E402
from core.errors import ConfigError, DataError  # noqa: E402

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        Collator,
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
except ImportError:  # the optional extra: whoever imports this module gets the one line naming it
    raise ConfigError(
        "harness: lm-evaluation-harness is not installed; pip install torchkiln[eval]",
        key="harness",
        value="lm_eval",
        valid=("pip install torchkiln[eval]",),
    ) from None
from text.generation import greedy_rows, stream  # noqa: E402
from text.tokenizer import ByteTokenizer, PretrainedTokenizer, Tokenizer, byte_level_backend  # noqa: E402

#: the datasets loaders that read local files (lm-eval's "local dataset" task option)
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")
#: HFLM's default of new tokens when a task names none
MAX_GEN_TOKS = 256


def token_text(tok: Tokenizer, token_id: int) -> str | None:
    """The text of one special token as the exported folder's tokenizer decodes it (None where the tokenizer
    has no Hugging Face form)."""
    backend = byte_level_backend() if isinstance(tok, ByteTokenizer) else getattr(tok, "backend", None)
    return None if backend is None else backend.id_to_token(token_id)


class HarnessLM(TemplateLM):
    """lm-eval's model interface on a torchkiln decoder (`text.llama`, `text.gpt`) and its tokenizer, under
    the run's device plan; `rank`/`world_size` split the requests over data-parallel processes."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        plan: DevicePlan,
        *,
        batch_size: int = 16,
        chat_template: Any = None,
        alone: bool = False,
    ) -> None:
        """Score with `model` (eval mode, on `plan.device`) and `tokenizer`, `batch_size` requests a forward;
        `chat_template` (a `text.chat.ChatTemplate`) renders chat-formatted requests; `alone` scores every
        request in this process, whatever torch.distributed holds (trainer.evals: rank 0 alone scores)."""
        super().__init__()
        self.model, self.tok, self.plan = model.eval(), tokenizer, plan
        self.batch_size = batch_size
        self.template = chat_template
        self.backend = "causal"
        self.max_length = int(model.context)
        self._prefix_text = token_text(tokenizer, tokenizer.doc_start_id)
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized() and not alone
        self._rank, self._world_size = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)

    # lm-eval reads these as properties of its LM base class
    @property
    def eot_token_id(self) -> int:
        """The end of text: the tokenizer's end of document."""
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and each rolling window start from: the document start (HFLM's BOS)."""
        return self.tok.doc_start_id

    @property
    def rank(self) -> int:
        """This process's rank among the data-parallel evaluators."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many processes share the requests."""
        return self._world_size

    @property
    def device(self) -> torch.device:
        """Where the model runs (lm-eval puts the ranks' request counts there to gather them)."""
        return self.plan.device

    @property
    def tokenizer_name(self) -> str:
        """The name lm-eval records the results under."""
        return f"torchkiln-{self.tok.name}"

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` from every rank, stacked (lm-eval pads the ranks' request counts with it)."""
        if self.world_size == 1:
            return tensor
        out = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, tensor)
        return torch.stack(out)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj` on `dst`."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            torch.distributed.barrier()

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **_: Any,
    ) -> list[int]:
        """`string`'s ids as the exported folder's tokenizer gives them: the document start first unless
        `add_special_tokens` is False (or None and the text already starts with that token's text)."""
        special = add_special_tokens
        if special is None:
            special = not (self._prefix_text and string.startswith(self._prefix_text))
        if not special:
            ids = self.tok.encode(string)
        elif isinstance(self.tok, PretrainedTokenizer):  # the folder's own post-processor decides
            ids = self.tok.backend.encode(string, add_special_tokens=True).ids
        else:
            ids = [self.tok.doc_start_id, *self.tok.encode(string)]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `tokens`, without the special tokens."""
        return self.tok.decode(list(tokens))

    def _model_call(self, batch: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, V) of a right-padded batch of ids, under the run's precision."""
        with torch.inference_mode(), self.plan.autocast():
            return self.model(batch.to(self.plan.device))

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) per request."""
        order = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[-2] + r[-1][:-1],
        )
        longest = max((len(cont) for _, _, cont in requests), default=0)
        if longest > self.max_length:  # HFLM asserts; its left truncation would cut into the continuation
            raise ConfigError(
                f"task.context={self.max_length}: a continuation of {longest} tokens does not fit the "
                "model's context; the task asks for a model of a longer one",
                key="task.context",
                value=str(self.max_length),
                valid=(f">= {longest}",),
            )
        results: list[tuple[float, bool]] = []
        for chunk in order.get_batched(n=self.batch_size):
            inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            width = max(len(i) for i in inputs)
            batch = torch.tensor([i + [0] * (width - len(i)) for i in inputs], dtype=torch.long)
            logits = self._model_call(batch)
            for (key, ctx, cont), ids, row in zip(chunk, inputs, logits, strict=True):
                # only the continuation's positions are normalized (fp32) (HFLM normalizes all): a position's
                # log-probabilities are its own row's, and with a vocabulary of 10^5 the rest costs
                rows = F.log_softmax(row[len(ids) - len(cont) : len(ids)].float(), dim=-1).cpu().unsqueeze(0)
                greedy = rows.argmax(dim=-1)
                for key_i, cont_i, rows_i in order.get_cache(
                    req_str=key, cxt_toks=ctx, cont_toks=cont, logits=rows
                ):
                    want = torch.tensor(cont_i, dtype=torch.long).unsqueeze(0)
                    exact = bool((greedy[:, -want.shape[1] :] == want).all())
                    picked = torch.gather(rows_i, 2, want.unsqueeze(-1)).squeeze(-1)
                    results.append((float(picked.sum()), exact))
                    if key_i is not None:
                        self.cache_hook.add_partial("loglikelihood", key_i, results[-1])
        return order.get_original(results)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in disjoint windows of the model's context (HFLM's)."""
        from lm_eval import utils

        windows, counts = [], []
        for (string,) in (r.args for r in requests):
            rolling = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            mine = [(None, *utils.make_disjoint_window(w)) for w in rolling]
            windows.extend(mine)
            counts.append(len(mine))
        pad = 0
        if self.world_size > 1:  # every rank runs the same number of forwards
            sizes = self.all_gather(torch.tensor(len(windows), device=self.plan.device)).tolist()
            pad = max(sizes) - len(windows)
            windows += pad * windows[:1]
        scores = self._loglikelihood_tokens(windows)
        scores = scores[: len(scores) - pad]
        totals, start = [], 0
        for (string,), n in zip((r.args for r in requests), counts, strict=True):
            totals.append(sum(s for s, _ in scores[start : start + n]))
            start += n
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), totals[-1])
        return totals

    def _stopped(self, ids: list[int], until: list[str]) -> bool:
        """Whether the text of `ids` holds one of the `until` strings."""
        text = self.tok_decode(ids)
        return any(u and u in text for u in until)

    def _generate_one(
        self, prompt: list[int], until: list[str], max_gen_toks: int, options: dict[str, Any]
    ) -> str:
        """The text sampled after `prompt` up to the first `until` string (removed), the end of text or
        `max_gen_toks` new tokens."""
        ids: list[int] = []
        start = torch.tensor(prompt, dtype=torch.long, device=self.plan.device)
        with self.plan.autocast():
            for nxt in stream(self.model, start, max_gen_toks, eos_id=self.eot_token_id, **options):
                ids.append(nxt)
                if self._stopped(ids, until):
                    break
        return postprocess_generated_text(generation=self.tok_decode(ids), stop=until, think_end_token=None)

    def _greedy_batch(self, prompts: list[list[int]], until: list[str], max_gen_toks: int) -> list[str]:
        """Greedy continuations of `prompts` (any lengths), one left-padded batch against one KV cache
        (`text.generation.greedy_rows`), each cut at its first `until` string."""
        with self.plan.autocast():
            new = greedy_rows(
                self.model,
                prompts,
                max_gen_toks,
                eos_id=self.eot_token_id,
                stop=lambda ids: self._stopped(ids, until),
            )
        return [postprocess_generated_text(self.tok_decode(ids), until, None) for ids in new]

    def _generation_limits(self, gen_kwargs: dict[str, Any], eos: str | None) -> tuple[list[str], int, dict]:
        """(the stop strings, the most new tokens, the other generation kwargs) of a request, as HFLM reads
        them; a task asking for as many new tokens as the context holds is a one-line ConfigError."""
        kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        most = int(kwargs.pop("max_gen_toks"))
        if most >= self.max_length:
            why = f"the task asks for more new tokens than the model's context ({self.max_length}) holds"
            raise ConfigError(
                f"max_gen_toks={most}: {why}",
                key="max_gen_toks",
                value=str(most),
                valid=(f"< {self.max_length}",),
            )
        return until, most, kwargs

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation (greedy where the task asks for no sampling)."""
        order = Collator(
            [r.args for r in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos = token_text(self.tok, self.eot_token_id)
        results: list[str] = []
        for chunk in order.get_batched(n=self.batch_size):
            until, max_gen_toks, kwargs = self._generation_limits(chunk[0][1], eos)  # one kwargs per chunk
            options = sampling_options(kwargs)
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_gen_toks) for c, _ in chunk]
            if options["temperature"] > 0 or "repetition_penalty" in options:  # each request alone
                texts = [self._generate_one(p, until, max_gen_toks, options) for p in prompts]
            else:  # greedy: the chunk decodes as one batch
                texts = self._greedy_batch(prompts, until, max_gen_toks)
            for (context, gen_kwargs), text in zip(chunk, texts, strict=True):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return order.get_original(results)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The run's chat template rendered over `chat_history` (lm-eval's `apply_chat_template=True`)."""
        return self.template.render(chat_history, add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer (lm-eval reads its chat template through `chat_template`)."""
        return self.tok

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template's source, which lm-eval records with the results."""
        return None if self.template is None or not chat_template else self.template.source


def training_evals(
    tokenizer: Tokenizer, names: Sequence[str], limit: float
) -> Callable[[nn.Module, DevicePlan], dict[str, float]]:
    """trainer.evals of an lm run: a function of (model, plan) giving lm-eval's metrics of the tasks `names`
    (the embedded ones of text.benchmarks included; at most `limit` documents each) as eval/<task>/<metric>,
    with eval/<task>/centered_<metric> ((x - baseline) / (1 - baseline), as nanochat reports CORE) for the
    accuracies of tasks with a known baseline. The tasks are checked now, before training."""
    from text.benchmarks import TASKS, baseline, task_folder

    manager = task_manager(names, [task_folder()])

    def run(model: nn.Module, plan: DevicePlan) -> dict[str, float]:
        lm = HarnessLM(model, tokenizer, plan, alone=True)  # under several ranks, rank 0 alone calls this
        results = evaluate_tasks(lm, names, manager, limit=limit)["results"]
        out: dict[str, float] = {}
        for task, row in results.items():
            for key, value in row.items():
                metric, _, _ = key.partition(",")
                if isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                    out[f"eval/{task}/{metric}"] = float(value)
                    if task in TASKS and metric in ("acc", "acc_norm", "exact_match"):
                        chance = baseline(task)
                        out[f"eval/{task}/centered_{metric}"] = (float(value) - chance) / (1 - chance)
        return out

    return run


def sampling_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`text.generation.stream`'s sampling keywords for a request's generation kwargs (greedy when
    `do_sample` is false, as HFLM; a repetition penalty applies either way, as in HFLM's `generate`)."""
    options: dict[str, Any] = {"temperature": 0.0}
    if kwargs.get("repetition_penalty") is not None and float(kwargs["repetition_penalty"]) != 1.0:
        options["repetition_penalty"] = float(kwargs["repetition_penalty"])
    if not kwargs.get("do_sample", False):
        return options
    options["temperature"] = float(kwargs.get("temperature", 1.0))
    if kwargs.get("top_k") is not None:
        options["top_k"] = int(kwargs["top_k"])
    if kwargs.get("top_p") is not None:
        options["top_p"] = float(kwargs["top_p"])
    if kwargs.get("min_p") is not None:
        options["min_p"] = float(kwargs["min_p"])
    return options


def _local_data_fault(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(key, value) of what makes a task's config read other than local files, or None where it reads
    only files that exist (relative paths from the working directory, as `datasets` reads them)."""
    loader = cfg.get("dataset_path")
    if loader not in LOCAL_LOADERS:
        return "dataset_path", str(loader)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not files:
        return "dataset_kwargs.data_files", ""
    groups = files.values() if isinstance(files, dict) else [files]
    for group in groups:
        for name in [group] if isinstance(group, str) else group:
            if not Path(name).expanduser().is_file():
                return "dataset_kwargs.data_files", str(name)
    return None


def _check_local(manager: Any, name: str, asked: str) -> None:
    """ConfigError naming `asked` unless task or group `name` and everything under it read local files."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index.get(name)
    if entry is None:
        raise ConfigError(
            f"harness.tasks={asked}: no task '{name}' in the included task folders (lm-eval's own tasks "
            "download their data, which this command never does); add its folder with harness.include=[DIR]",
            key="harness.tasks",
            value=name,
            valid=tuple(manager.all_tasks),
        )
    if entry.kind == Kind.TAG:
        members = [e.name for e in manager.task_index.values() if name in e.tags and e.name != name]
        for member in members:
            _check_local(manager, member, asked)
    elif entry.kind == Kind.GROUP:
        for sub in entry.cfg.get("task", []):
            _check_local(manager, sub, asked) if isinstance(sub, str) else _check_config(sub, asked, entry)
    else:
        _check_config(entry.cfg, asked, entry)


def _check_config(cfg: dict[str, Any], asked: str, entry: Any) -> None:
    """ConfigError naming the task and its offending key unless `cfg` reads only local files."""
    if "class" in cfg:
        fault: tuple[str, str] | None = ("class", str(cfg["class"]))
    else:
        fault = _local_data_fault(cfg)
    if fault is not None:
        key, value = fault
        missing = key == "dataset_kwargs.data_files" and value
        raise (DataError if missing else ConfigError)(
            f"harness.tasks={asked}: task {cfg.get('task', entry.name)} ({entry.yaml_path}) "
            + (
                f"reads {value}, which does not exist"
                if missing
                else f"has {key}={value or 'none'}: only local files (dataset_path: "
                f"{'|'.join(LOCAL_LOADERS)} with dataset_kwargs.data_files) run offline"
            ),
            key=f"harness.tasks.{key}",
            value=value,
        )


def _check_yaml_files(folders: Sequence[Path]) -> None:
    """ConfigError naming the first task YAML in `folders` that does not parse (lm-eval would skip it in
    silence, and its task would then read as unknown)."""
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(
                f"harness.include={folder}: no such folder of task YAMLs",
                key="harness.include",
                value=str(folder),
            )
        for path in TaskIndex._iter_yaml_files(folder):
            try:
                cfg = load_yaml(path, resolve_func=False)
                TaskIndex._kind_of(cfg)
            except Exception as e:  # noqa: BLE001  (YAML, include and shape errors alike)
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(
                    f"harness.include: {path} is not a task YAML lm-eval can read ({first})",
                    key="harness.include",
                    value=str(path),
                ) from None


def task_manager(tasks: Sequence[str], folders: Sequence[Path]) -> Any:
    """lm-eval's TaskManager over `folders` alone (its own tasks download their data), every task in
    `tasks` checked to read only local files: one ConfigError/DataError naming the first that does not."""
    from lm_eval.tasks import TaskManager

    _check_yaml_files(folders)
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    for name in tasks:
        _check_local(manager, name, name)
    return manager


@contextlib.contextmanager
def datasets_cache() -> Iterator[Path]:
    """A private `datasets` cache for one evaluation: nothing lands in the user's ~/.cache."""
    import datasets

    with tempfile.TemporaryDirectory(prefix="torchkiln-harness-") as tmp:
        before = datasets.config.HF_DATASETS_CACHE
        datasets.config.HF_DATASETS_CACHE = Path(tmp)
        try:
            yield Path(tmp)
        finally:
            datasets.config.HF_DATASETS_CACHE = before


def evaluate_tasks(
    lm: HarnessLM,
    tasks: Sequence[str],
    manager: Any,
    *,
    limit: float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
) -> dict[str, Any]:
    """lm-eval's results dict (`simple_evaluate`'s) of `lm` on `tasks` of `manager`; None on ranks other
    than 0, as lm-eval returns."""
    from lm_eval.evaluator import simple_evaluate

    with datasets_cache():
        return simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            log_samples=False,
        )


def results_json(results: dict[str, Any]) -> str:
    """`results` as lm-eval's EvaluationTracker writes its results_*.json."""
    import json

    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own table(s) of `results` (its tasks, then its groups where there are)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if "groups" in results else "")
