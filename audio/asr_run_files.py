"""What an ASR run keeps of its model beside the checkpoints, so eval, predict, export and resume need neither
the training data nor the pretrained weights file: the tokenizer (a learned subword vocabulary, or a copy of
Whisper's) and the sizes a pretrained file's own config gave the model. The decoder's files (lexicon, n-gram):
`audio.asr_decoding.Decoding.save`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from audio.asr_model import ASRModel
from audio.checkpoints.json_files import saved_sizes
from audio.ctc import SubwordTokenizer
from audio.whisper import WhisperTokenizer
from core.files import write_text_atomic

#: a subword tokenizer learned from the training transcripts (the `tokenizers` library's JSON), or Whisper's
TOKENIZER_FILE = "tokenizer.json"
#: the sizes a pretrained file's own config gave the model (JSON): the run's checkpoints are of that shape
PRETRAINED_SIZES_FILE = "pretrained_sizes.json"


def save_model_files(run_dir: Path, tokenizer: object, pretrained_sizes: Mapping[str, Any]) -> None:
    """tokenizer.json: a subword (or Whisper's) vocabulary; pretrained_sizes.json: the sizes a pretrained
    file's config set (nothing for a character tokenizer or a model built from scratch)."""
    if pretrained_sizes:  # JSON writes the conv layers' tuples as lists, which the model takes
        write_text_atomic(run_dir / PRETRAINED_SIZES_FILE, json.dumps(dict(pretrained_sizes)) + "\n")
    if isinstance(tokenizer, SubwordTokenizer):
        write_text_atomic(run_dir / TOKENIZER_FILE, tokenizer.to_json())
    elif isinstance(tokenizer, WhisperTokenizer):  # the run's own copy: eval needs no weights folder
        write_text_atomic(run_dir / TOKENIZER_FILE, tokenizer.json)


def saved_model_config(
    run_dir: Path, model_cfg: Mapping[str, Any], model_class: type[ASRModel]
) -> dict[str, Any]:
    """The model config that rebuilds a run's model without its `model.weights` file (the run's own weights
    replace the pretrained ones, and the file may be on another machine): the sizes the run saved in its
    place, and a sequence-to-sequence model's tokenizer from the run's copy."""
    cfg = dict(model_cfg)
    if cfg.pop("weights", None):
        cfg.update(saved_sizes(run_dir / PRETRAINED_SIZES_FILE, model_class.size_keys))
    if model_class.seq2seq:
        cfg.pop("sha256", None)
        if (run_dir / TOKENIZER_FILE).is_file():
            cfg["tokenizer"] = str(run_dir / TOKENIZER_FILE)
    return cfg


def saved_tokenizer(run_dir: Path, tokenizer_kind: str) -> SubwordTokenizer | None:
    """The subword vocabulary a run learned (task.tokenizer=bpe/unigram), or None: characters, or a run
    from before it was saved (the vocabulary is learned again from the data)."""
    if tokenizer_kind != "chars" and (run_dir / TOKENIZER_FILE).is_file():
        return SubwordTokenizer.from_json((run_dir / TOKENIZER_FILE).read_text())
    return None
