"""`model=llama model.weights=DIR` against transformers' own LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MistralForCausalLM and Qwen3MoeForCausalLM: tiny random models saved with save_pretrained
(safetensors, one file and sharded), loaded by `text.checkpoints.hf`; logits within 1e-5 in fp32 on a
right-padded batch, the same greedy ids as `generate(do_sample=False)`, a bit-exact write/read round trip,
and the ConfigError fields of a folder that does not fit. The reference is the test-only `hf` extra
(pyproject.toml)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.registry import MODELS
from tests.helpers import TINY_RUN, fault
from text.checkpoints.hf import expected_tensors, write_folder
from text.generation import generate, sample_rows
from text.llama import Llama

transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")

VOCAB = 300
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query: two query heads per key/value head
    "max_position_embeddings": 128,
    "initializer_range": 0.1,  # wider than the default 0.02, so the logits (and greedy picks) differ clearly
    "bos_token_id": None,
    "eos_token_id": None,  # generation runs its full length in both libraries
    "pad_token_id": None,
}
# Llama 3's scaling with the original context at 64 positions: of head_dim 8's four frequencies (theta
# 10,000), one is kept, one blended, two slowed, so every branch of the scaling is exercised
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 64,
}
MOE = {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_untied": ("Llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama_tied_bias": ("Llama", {"tie_word_embeddings": True, "attention_bias": True}),
    "qwen2_tied": ("Qwen2", {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}}),
    "qwen3_untied": ("Qwen3", {"head_dim": 16, "tie_word_embeddings": False}),  # head_dim != 32 / 4
    "mistral_untied": ("Mistral", {"sliding_window": None, "tie_word_embeddings": False}),
    # mixtures of experts, 2 of 4 (text.moe; tests/text/test_moe.py): block 1 dense by mlp_only_layers,
    # block 0 by decoder_sparse_step
    "qwen3_moe_untied": ("Qwen3Moe", {**MOE, "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 8}),
    "qwen3_moe_tied": ("Qwen3Moe", {**MOE, "decoder_sparse_step": 2, "tie_word_embeddings": True}),
}
#: the GPU tests' cases: the dense ones (a stacked expert's per-expert slices hold no .grad of their own)
DENSE = [case for case, (family, _) in CASES.items() if family != "Qwen3Moe"]


def reference(case: str, seed: int = 0) -> Any:
    """A random transformers model of `case`, in eval mode, its norms' gains away from 1."""
    family, options = CASES[case]
    config = getattr(transformers, f"{family}Config")(**COMMON, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Each case's reference model and the folder save_pretrained wrote it to (safetensors, one file)."""
    out = {}
    for case in CASES:
        model = reference(case)
        folder = tmp_path_factory.mktemp(case)
        model.save_pretrained(folder)
        out[case] = (model, folder)
    return out


def ours(folder: Path) -> Llama:
    return MODELS.build("llama", vocab_size=VOCAB, context=64, weights=str(folder)).eval()


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_on_a_right_padded_batch(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=mask).logits
        # the padding is a second document of each row: the real tokens never attend to it
        got = model(tokens, 1 - mask)
    real = mask.bool()
    assert want[real].abs().max() > 0.1  # logits far from flat, so 1e-5 is a real test
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def greedy_ids(
    theirs: Any,
    model: Llama,
    device: str = "cpu",
    ids: Sequence[int] = (5, 77, 123, 9, 250, 31),
    **options: Any,
) -> tuple[list[int], list[int]]:
    """24 greedy ids after the prompt `ids` on `device`: (transformers' `generate`, ours), `options` (e.g.
    repetition_penalty) given to both."""
    prompt = torch.tensor(list(ids), device=device)
    with torch.no_grad():
        want = theirs.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=24,
            do_sample=False,
            **options,
        )[0, len(prompt) :]
    return want.tolist(), generate(model, prompt, 24, temperature=0.0, **options).tolist()


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_gives_transformers_ids(case: str, folders: dict) -> None:
    ref, folder = folders[case]
    want, got = greedy_ids(ref, ours(folder))
    assert got == want
    assert len(set(got)) > 1  # not one token repeated: the ids depend on the model's every step


def test_greedy_generation_with_a_repetition_penalty_gives_transformers_ids(folders: dict) -> None:
    ref, folder = folders["llama3_untied"]
    model = ours(folder)
    prompts = [[5, 77, 123, 9, 250, 31], [77, 77, 3]]
    for penalty in (1.5, 0.8):  # below 1 the seen tokens are favoured
        for prompt in prompts:
            want, got = greedy_ids(ref, model, ids=prompt, repetition_penalty=penalty)
            assert got == want
            assert want != greedy_ids(ref, model, ids=prompt)[0]
        # a batch of both prompts (left-padded; the padding is no row's token) decodes each as alone
        batch = sample_rows(model, prompts, 24, temperature=0.0, repetition_penalty=penalty)
        assert batch.ids == [
            generate(model, torch.tensor(p), 24, temperature=0.0, repetition_penalty=penalty).tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("case", CASES)
def test_write_then_read_back_is_bit_exact_in_both_libraries(
    case: str, folders: dict, tmp_path: Path
) -> None:
    ref, folder = folders[case]
    model = ours(folder)
    write_folder(model, tmp_path)
    back = type(ref).from_pretrained(tmp_path).eval()
    want = ref.state_dict()
    assert back.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items())
    assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings
    again = ours(tmp_path)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in again.state_dict().items())
    assert again.config == model.config


@pytest.mark.parametrize("case", ["llama3_untied", "qwen3_moe_untied"])
def test_a_sharded_folder_loads_the_same_tensors(case: str, folders: dict, tmp_path: Path) -> None:
    ref, folder = folders[case]
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded, single = ours(tmp_path), ours(folder)
    assert all(torch.equal(t, single.state_dict()[k]) for k, t in sharded.state_dict().items())


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of the folder `src` whose config.json has `changes`."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes))
    return dst


def test_a_folder_that_does_not_fit_names_its_first_mismatch(folders: dict, tmp_path: Path) -> None:
    _, folder = folders["llama3_untied"]
    other = _edit_config(folder, tmp_path / "phi", architectures=["PhiForCausalLM"])
    with pytest.raises(ConfigError) as err:
        ours(other)
    assert fault(err.value)[:2] == ("architectures", "PhiForCausalLM")
    # sizes from the config that the tensors do not have: the first tensor built from them is named
    wider = _edit_config(folder, tmp_path / "wider", intermediate_size=72)
    with pytest.raises(ConfigError) as err:
        ours(wider)
    assert fault(err.value) == ("model.layers.0.mlp.gate_proj.weight", "(64, 32)", ("(72, 32)",))
    # a Qwen3 config over Llama tensors: the QK-norms it needs are absent
    qwen3 = _edit_config(folder, tmp_path / "qwen3", architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    with pytest.raises(ConfigError) as err:
        ours(qwen3)
    assert fault(err.value)[:2] == ("model.layers.0.self_attn.q_norm.weight", "missing")
    # a Mistral attending within a sliding window: refused by the key, not computed without the window
    _, mistral = folders["mistral_untied"]
    windowed = _edit_config(mistral, tmp_path / "windowed", sliding_window=16)
    with pytest.raises(ConfigError) as err:
        ours(windowed)
    assert fault(err.value)[:2] == ("sliding_window", "16")


def test_a_context_past_the_folders_positions_is_warned_naming_both(
    folders: dict, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    from text.pretrained import build_llama

    _, folder = folders["qwen2_tied"]
    positions = COMMON["max_position_embeddings"]
    build_llama(weights=str(folder), context=positions)
    build_llama(weights=str(folder), context=2 * positions)
    said = [x for x in (capsys.readouterr().out + caplog.text).splitlines() if "warning" in x]  # print or log
    assert len(said) == 1 and f"task.context={2 * positions}" in said[0] and str(positions) in said[0]


def test_pickled_weights_are_refused_unread(folders: dict, tmp_path: Path) -> None:
    _, folder = folders["llama3_untied"]
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read: a pickle could run code")
    with pytest.raises(ConfigError) as err:
        ours(tmp_path)
    assert fault(err.value) == (
        "model.weights",
        str(tmp_path),
        ("model.safetensors", "model.safetensors.index.json"),
    )


def test_the_recipe_exits_2_on_a_folder_of_another_architecture(folders: dict, tmp_path: Path) -> None:
    from recipes.train import main

    _, folder = folders["llama3_untied"]
    other = _edit_config(folder, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    args = ["+task=lm", "model=llama", f"model.weights={other}", "trainer=smoke", "logger=none"]
    try:
        code = main([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 2


# The after-training commands given an HF folder in place of a run (recipes.cli.runs.hf_run_config)
TEXT = " ".join(
    f"And God said, Let there be light: and there was light {i}. And the evening and the morning were the "
    f"day {i}, and the earth brought forth grass and herb yielding seed after his kind."
    for i in range(12)
)


@pytest.fixture(scope="module", params=["qwen3_untied", "qwen3_moe_untied"])
def with_tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path, Any]:
    """A Qwen3 (and a Qwen3-MoE) reference saved with a byte-level BPE tokenizer.json (its ids within the
    model's 300) and the tokenizer's end of document as config.json's eos_token_id: (reference, folder,
    tokenizer)."""
    from text.tokenizer import BPETokenizer

    folder = tmp_path_factory.mktemp(f"{request.param}_tok")
    tok = BPETokenizer.train([TEXT], VOCAB, cache_dir=tmp_path_factory.mktemp("bpe_cache"))
    assert tok.vocab_size <= VOCAB
    ref = reference(request.param)
    ref.config.eos_token_id = ref.generation_config.eos_token_id = tok.eos_id
    ref.save_pretrained(folder, safe_serialization=True)
    tok.backend.save(str(folder / "tokenizer.json"))
    return ref, folder, tok


def test_generate_from_an_hf_folder_gives_transformers_greedy_ids(with_tokenizer: tuple) -> None:
    from tests.helpers import run_here

    ref, folder, tok = with_tokenizer
    prompt = "And God said"
    args = [f"ckpt={folder}", f"prompt={prompt}", "temperature=0", "max_new_tokens=16", "device=cpu"]
    proc = run_here("recipes.generate", *args, "precision=fp32")
    assert proc.returncode == 0, proc.stderr
    ids = [tok.eos_id, *tok.encode(prompt)]  # the lm task starts a prompt as a document
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=tok.eos_id,
        )[0, len(ids) :].tolist()
    assert len(want) > 4 and len(set(want)) > 1  # a real continuation, not one id repeated or stopped at once
    assert proc.stdout.rstrip("\n") == tok.decode(ids + want)


def test_eval_of_an_hf_folder_gives_transformers_loss(with_tokenizer: tuple, tmp_path: Path) -> None:
    from recipes.cli.runs import apply_overrides, hf_run_config
    from recipes.cli.tasks import build_task
    from tests.helpers import run_here

    ref, folder, _ = with_tokenizer
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "genesis.txt").write_text(TEXT)
    data = ["data=text_files", f"data.root={tmp_path / 'text'}", "data.val_fraction=0.5", "task.context=32"]
    out = tmp_path / "eval.json"
    proc = run_here("recipes.eval", f"ckpt={folder}", *data, "device=cpu", "precision=fp32", f"out={out}")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())["metrics"]["val/loss"]
    # the reference: transformers' own loss (labels shifted inside) over the same validation chunks
    overrides = [o if "." in o.split("=")[0] else o.replace("=", ".name=", 1) for o in data]
    _, val = build_task(apply_overrides(hf_run_config(folder), overrides)).build_datasets()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y, d in (val[i] for i in range(len(val))):
            assert (d == d[0]).all()  # one validation document: no boundary inside a chunk
            ids = torch.cat([x, y[-1:]])[None]
            total += ref(input_ids=ids, labels=ids).loss.item() * len(y)
            count += len(y)
    assert len(val) >= 3
    assert got == pytest.approx(total / count, abs=1e-5)


def test_an_hf_folder_of_another_architecture_is_one_line_exit_2(
    with_tokenizer: tuple, tmp_path: Path
) -> None:
    from tests.helpers import run_here

    _, folder, _ = with_tokenizer
    other = _edit_config(folder, tmp_path / "phi", architectures=["PhiForCausalLM"])
    for module, extra in (("recipes.generate", "prompt=x"), ("recipes.eval", "task.context=32")):
        proc = run_here(module, f"ckpt={other}", extra)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "architectures" in lines[0] and "PhiForCausalLM" in lines[0]


# bpe in the slow suite: the bytes run covers the same export path in the default one
@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("bpe", marks=pytest.mark.slow)])
def test_an_exported_run_tokenizes_and_generates_in_transformers_as_the_run_does(
    tokenizer: str, tmp_path: Path
) -> None:
    from recipes.cli.runs import load_run
    from tests.helpers import run_here, train

    run = train(tmp_path / "run", [*TINY_RUN, f"tokenizer={tokenizer}"])
    proc = run_here("recipes.export", f"ckpt={run}", "format=hf")
    assert proc.returncode == 0, proc.stderr
    folder = run / "export" / "hf"
    tok = load_run(run, device="cpu").task.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    text = "And God said, Let there be light: and there was light. \u00c9den \u4e2d"
    ids = [tok.doc_start_id, *tok.encode(text)]  # a text starts a document, as in the run's rows
    assert theirs(text)["input_ids"] == ids
    assert theirs.decode(ids, skip_special_tokens=True) == text
    assert (theirs.eos_token_id, theirs.pad_token_id) == (tok.eos_id, tok.pad_id)
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.doc_start_id, tok.eos_id)
    # recipes.generate reads the folder alone and continues a prompt as transformers' greedy search does
    prompt = "And God said"
    gen = run_here(
        "recipes.generate", f"ckpt={folder}", f"prompt={prompt}", "temperature=0", "max_new_tokens=12"
    )
    assert gen.returncode == 0, gen.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    start = theirs(prompt, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**start, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert gen.stdout.rstrip("\n") == theirs.decode(new[0], skip_special_tokens=True)
    assert len(new[0]) == len(start["input_ids"][0]) + 12


def test_a_bpe_chat_template_goes_into_the_exported_tokenizer_config(tmp_path: Path) -> None:
    from text.chat import CHATML, ChatTemplate
    from text.tokenizer import BPETokenizer, write_hf_tokenizer

    tok = BPETokenizer.train([TEXT, "<|im_start|>user\nWhich book?<|im_end|>\n"], VOCAB, cache_dir=tmp_path)
    ids = write_hf_tokenizer(tok, tmp_path, context=64, chat_template=CHATML)
    assert ids == {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    conv = [
        {"role": "user", "content": "Which book holds this verse?"},
        {"role": "assistant", "content": "Job"},
    ]
    for upto, prompt in ((conv[:1], True), (conv, False)):
        want = ChatTemplate(CHATML).render(upto, add_generation_prompt=prompt)
        assert theirs.apply_chat_template(upto, tokenize=False, add_generation_prompt=prompt) == want
    assert theirs.model_max_length == 64


def test_a_tokenizer_without_a_hugging_face_form_is_a_config_error(tmp_path: Path) -> None:
    from text.tokenizer import Tokenizer, write_hf_tokenizer

    class Words(Tokenizer):  # any kind but bytes, bpe and pretrained, as torchtext's word vocabulary
        name, vocab_size, pad_id, eos_id = "torchtext", 10, 0, 1

        def encode(self, text: str) -> list[int]:
            return [2] * len(text.split())

        def decode(self, ids: Sequence[int]) -> str:
            return " ".join("w" for _ in ids)

    with pytest.raises(ConfigError) as err:
        write_hf_tokenizer(Words(), tmp_path, context=8)
    assert fault(err.value)[:2] == ("tokenizer", "torchtext")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # two spawned interpreters: 8-18 s on 2 shared cores
def test_a_2_rank_fsdp_load_equals_the_1_process_load(
    folders: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.multiprocessing as mp

    from tests.text import parallel_cases

    _, folder = folders["llama3_untied"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned interpreters read it when torch starts
    args = (2, str(tmp_path), str(folder), VOCAB)
    mp.spawn(parallel_cases.hf_load_worker, args=args, nprocs=2, join=True)
    want = ours(folder).state_dict()
    whole = sum(t.numel() * t.element_size() for t in want.values())
    for rank in range(2):
        got = torch.load(tmp_path / f"hf_rank{rank}.pt", weights_only=True)
        for layout in ("fsdp", "tp"):
            assert got[layout]["state"].keys() == want.keys()
            # bit for bit
            assert all(torch.equal(got[layout]["state"][k], t) for k, t in want.items()), layout
        assert got["fsdp"]["all_dtensors"]  # every parameter sharded: no rank holds one whole
        assert 0.45 < got["fsdp"]["resident"] / whole < 0.55  # half the model's bytes (the widths are even)
        # TP shards the blocks' projections; embeddings, norms and head stay whole on every rank
        assert got["tp"]["resident"] < whole


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "tp"])
def test_a_sharded_run_of_an_hf_folder_loads_it_by_shards_and_trains_as_one_process(
    parallel: str, folders: dict, tmp_path: Path
) -> None:
    # recipes.train on 2 gloo ranks (in-process ranks, load_sharded watched) against the same run in one
    # process: the trainer builds the model on the meta device, shards it, each rank reads its slices, and
    # the losses step by step equal the one-process run's (which loads the whole folder up front)
    import socket

    import torch.multiprocessing as mp

    from tests.helpers import read_metrics, train
    from tests.text import parallel_cases

    _, folder = folders["llama3_untied"]
    args = ["+task=lm", "model=llama", f"model.weights={folder}", "trainer=smoke", "task.context=32"]
    args += ["trainer.batch_size=4", "precision=fp32", "compile.policy=off", "logger=none"]
    one = train(tmp_path / "one", args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "two"
    argv = [*args, f"trainer.parallel={parallel}", f"hydra.run.dir={run}"]
    mp.spawn(parallel_cases.hf_fit_worker, args=(2, str(tmp_path), port, argv), nprocs=2, join=True)
    whole = sum(t.numel() * t.element_size() for t in ours(folder).state_dict().values())
    for rank in range(2):
        seen = torch.load(tmp_path / f"fit_rank{rank}.pt", weights_only=True)
        assert seen["meta"]  # built on the meta device, sharded before a byte was read
        # FSDP shards every parameter; TP the blocks' projections (embeddings, norms, head stay whole)
        assert all(seen["dtensors"]) if parallel == "fsdp" else any(seen["dtensors"])
        assert seen["resident"] < (0.55 if parallel == "fsdp" else 1) * whole
    losses = {r: [row["train/loss"] for row in read_metrics(r) if "train/loss" in row] for r in (one, run)}
    assert len(losses[one]) == 5
    torch.testing.assert_close(losses[run], losses[one], rtol=1e-5, atol=1e-6)


# --- on a CUDA device (pytest -m gpu; skipped without one: scripts/gpu_checks.sh) -------------------------
# On CUDA our padded batch runs as packed documents through the device plan's first attention backend (the
# Triton kernels where triton is installed), transformers' through SDPA with its own mask: the same sums in
# another order, so fp32 agrees to reduction-order rounding, not the CPU's 1e-5.
CUDA_TOL_FP32 = 1e-4


def _cuda_pair(case: str, folders: dict) -> tuple[Any, Llama, torch.Tensor, torch.Tensor]:
    """transformers' model and ours, both from `case`'s folder, on CUDA; a right-padded batch and its mask."""
    ref, folder = folders[case]
    theirs = type(ref).from_pretrained(folder).cuda().eval()  # a copy: the module fixture's stays on the CPU
    tokens = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones(3, 40, dtype=torch.long, device="cuda")
    mask[1, 27:] = 0
    mask[2, 9:] = 0
    return theirs, ours(folder).cuda(), tokens, mask


@pytest.mark.gpu
@pytest.mark.parametrize("case", DENSE)
def test_cuda_logits_and_gradients_equal_transformers_in_fp32(
    case: str, folders: dict, ieee_matmuls: None
) -> None:
    theirs, model, tokens, mask = _cuda_pair(case, folders)
    real = mask.bool()
    want = theirs(input_ids=tokens, attention_mask=mask).logits
    got = model(tokens, 1 - mask)
    torch.testing.assert_close(got[real], want[real], atol=CUDA_TOL_FP32, rtol=0)
    # the same loss on both: every parameter's gradient, by its Hugging Face name
    want[real].logsumexp(-1).mean().backward()
    got[real].logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    for name, p in expected_tensors(model).items():
        scale = grads[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(p.grad, grads[name], atol=CUDA_TOL_FP32 * max(scale, 1.0), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", DENSE)
def test_cuda_bf16_autocast_is_as_close_to_fp32_as_transformers_bf16(
    case: str, folders: dict, ieee_matmuls: None
) -> None:
    # the reference in fp32 against each library under bf16 autocast: ours within twice transformers' error
    # (plus a floor at bf16's rounding of O(1) logits)
    theirs, model, tokens, mask = _cuda_pair(case, folders)
    real = mask.bool()
    with torch.no_grad():
        exact = theirs(input_ids=tokens, attention_mask=mask).logits[real]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours_bf16 = model(tokens, 1 - mask)[real].float()
            theirs_bf16 = theirs(input_ids=tokens, attention_mask=mask).logits[real].float()
    ours_err = (ours_bf16 - exact).abs().max().item()
    theirs_err = (theirs_bf16 - exact).abs().max().item()
    assert ours_err <= 2 * theirs_err + 1e-2, f"ours {ours_err:.3g} vs transformers {theirs_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama3_untied", "qwen3_untied"])
def test_cuda_greedy_generation_gives_transformers_ids(case: str, folders: dict, ieee_matmuls: None) -> None:
    theirs, model, _, _ = _cuda_pair(case, folders)
    want, got = greedy_ids(theirs, model, "cuda")
    assert got == want
