"""Reward models as +task=grpo rewards (text/reward_model.py): a transformers `*ForSequenceClassification`
folder scores a completion as transformers does (the same ids, the same logit, a right-padded batch's rows
at their last token that is not the pad id), a conversation through the folder's own chat template as
`apply_chat_template` renders it; named in task.rewards by its path, it scores a GRPO draw; a folder of
another class is one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from text import rewards as rw
from text.chat import CHATML
from text.reward_model import RewardModel

transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")

TEXT = " ".join(
    f"And God said, Let there be light: and there was light {i}. And the evening and the morning were the "
    f"day {i}, and the earth brought forth grass and herb yielding seed after his kind."
    for i in range(12)
)
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # logits far apart, so equal scores are a real test
}


@pytest.fixture(scope="module", params=["Llama", "Qwen3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A random transformers reward model (one label) saved with a byte-level BPE tokenizer.json and a
    ChatML chat template: (the model, its folder)."""
    from text.tokenizer import BPETokenizer

    out = tmp_path_factory.mktemp(f"rm_{request.param}")
    tok = BPETokenizer.train([TEXT], 300, cache_dir=tmp_path_factory.mktemp("bpe"))
    config = getattr(transformers, f"{request.param}Config")(
        vocab_size=300, num_labels=1, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, **SIZES
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{request.param}ForSequenceClassification")(config).eval()
    model.save_pretrained(out)
    tok.backend.save(str(out / "tokenizer.json"))
    special = {
        "eos_token": tok.backend.id_to_token(tok.eos_id),
        "pad_token": tok.backend.id_to_token(tok.pad_id),
    }
    config_file = out / "tokenizer_config.json"
    config_file.write_text(json.dumps({"chat_template": CHATML, **special}), encoding="utf-8")
    return model, out


def hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the folder."""
    return transformers.AutoTokenizer.from_pretrained(path)


PROMPTS: list[Any] = [
    "And God said, Let there be",
    [{"role": "user", "content": "What was there?"}],
    "In the",
]
COMPLETIONS: list[Any] = [
    " light",
    [{"role": "assistant", "content": "light, and the evening"}],
    " beginning God",
]


def test_the_scores_are_transformers_logits_of_the_texts_trl_builds(folder: tuple[Any, Path]) -> None:
    ref, path = folder
    ours = RewardModel(path)
    theirs_tok = hf_tokenizer(path)
    texts = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
        if isinstance(prompt, str):
            texts.append(prompt + completion)
        else:  # TRL's: the conversation through the reward model's template, no generation prompt
            texts.append(theirs_tok.apply_chat_template([*prompt, *completion], tokenize=False))
    assert [ours.text(p, c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)] == texts
    batch = theirs_tok(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    assert [ours.tokenizer.encode(t) for t in texts] == [
        ids[: int(m.sum())]
        for ids, m in zip(batch["input_ids"].tolist(), batch["attention_mask"], strict=True)
    ]
    with torch.no_grad():
        want = ref(**batch).logits[:, 0]  # TRL's reward: the first label's logit
    got = ours(PROMPTS, COMPLETIONS, completion_ids=[[0]] * 3)
    torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-5)
    assert max(got) - min(got) > 1e-2  # the texts score apart
    # one at a time, each row as in the batch
    alone = [ours([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(got), rtol=0, atol=1e-5)


def test_a_row_ending_in_the_pad_id_is_scored_before_it_as_transformers_does(
    folder: tuple[Any, Path],
) -> None:
    ref, path = folder
    ours = RewardModel(path)
    ids = ours.tokenizer.encode("And the evening")
    assert ours.pad_id is not None
    rows = [ids + [ours.pad_id], ids + [5, 6]]
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [ours.pad_id] * (width - len(r)) for r in rows])
    with torch.no_grad():
        want = ref(input_ids=tokens).logits[:, 0]
    torch.testing.assert_close(torch.tensor(ours._scores(rows)), want, rtol=0, atol=1e-5)


def test_a_reward_models_folder_in_task_rewards_scores_a_grpo_draw(folder: tuple[Any, Path]) -> None:
    from text.grpo import GroupRelativePolicyOptimization

    _, path = folder
    task = GroupRelativePolicyOptimization(
        model={"name": "llama", "n_layer": 1, "d_model": 32, "n_head": 4, "n_kv_head": 2, "hidden": 64},
        data={"name": "prompts", "count": 40},
        context=96,
        group_size=3,
        max_new_tokens=5,
        rewards=[str(path), "length"],
    )
    name, reward = task.rewards[0]
    assert isinstance(reward, RewardModel) and name == path.name  # logged by its folder's name, as TRL's
    torch.manual_seed(0)
    model = task.build_model()
    rows = task.build_datasets()[0].rows[:2]
    drawn = task.draw(model, rows)
    # the completions as TRL gives a conversational prompt's: assistant messages
    completions = [[{"role": "assistant", "content": t}] for t in drawn.texts]
    prompts = [r.prompt for r in rows for _ in range(3)]
    torch.testing.assert_close(
        drawn.scores[:, 0], torch.tensor(reward(prompts, completions), dtype=torch.float64)
    )
    assert float(drawn.scores[:, 0].std()) > 0  # the completions score apart: a signal to train on


def test_a_folder_that_is_no_reward_model_is_one_line_naming_the_key(tmp_path: Path) -> None:
    from text.checkpoints.hf import write_folder
    from text.llama import DecoderConfig, Llama

    sizes = {"vocab_size": 64, "context": 32, "n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 16}
    write_folder(Llama(DecoderConfig(**sizes, hidden=32)), tmp_path)
    with pytest.raises(ConfigError) as e:
        rw.resolve(str(tmp_path), {})
    assert (e.value.key, e.value.value) == ("architectures", "LlamaForCausalLM")
