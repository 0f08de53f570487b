"""Tokenizers behind one interface, chosen by name: `bytes`, `bpe` (HF tokenizers), `pretrained` (the
tokenizer.json of the `model.weights` folder) or `torchtext` (legacy).

Every tokenizer maps text to ids in `[0, vocab_size)` and back, and reserves a padding id and an
end-of-document id. `bytes` is exact and needs no training; `bpe` is trained on the training texts and cached
on disk keyed by their hash; `torchtext` is the classic torchtext pipeline (basic_english word splitting and a
vocabulary from `build_vocab_from_iterator`), available only where torchtext 0.18 loads (torch 2.3).
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ConfigError, unknown_choice
from core.files import cache_root, write_text_atomic

TOKENIZERS = ("bytes", "bpe", "pretrained", "torchtext")
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
#: the files of a Hugging Face model folder, besides its config and weights, that say how text becomes ids and
#: back and where generation stops: data that `tokenizers` and transformers read, never code. An export of a
#: tokenizer=pretrained run copies those its folder has.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


class Tokenizer(abc.ABC):
    """Text <-> token ids; `pad_id` and `eos_id` are reserved ids that `decode` drops."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping the padding and end-of-document ids."""

    @property
    def doc_start_id(self) -> int:
        """The id every document (packed chunk, prompt, conversation) starts with: the end-of-document id
        here, so a model learns how documents begin from the one before's end; a pretrained tokenizer whose
        model was trained with a BOS token starts with that instead."""
        return self.eos_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts (subclasses batch it when the backend can)."""
        return [self.encode(t) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then padding (256) and end of document (257); exact round trip."""

    name = "bytes"
    vocab_size = 258
    pad_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; a sampled invalid UTF-8 sequence becomes U+FFFD rather than an error."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """Byte-level BPE from the `tokenizers` library: exact round trip, vocabulary learned from the corpus."""

    name = "bpe"

    def __init__(self, backend: object) -> None:
        """Wrap a trained `tokenizers.Tokenizer` that has the PAD and EOS special tokens."""
        self.backend = backend
        self.vocab_size = backend.get_vocab_size()
        self.pad_id = backend.token_to_id(PAD)
        self.eos_id = backend.token_to_id(EOS)

    def encode(self, text: str) -> list[int]:
        """BPE ids of `text`."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """BPE ids of many texts, encoded in parallel by the Rust backend."""
        return [e.ids for e in self.backend.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int, cache_dir: Path | None = None) -> BPETokenizer:
        """Train on `texts`, or load the tokenizer cached for exactly these texts and `vocab_size`."""
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 258:
            raise ConfigError(
                f"task.bpe_vocab_size={vocab_size} is too small; byte-level BPE needs at least 258",
                key="task.bpe_vocab_size",
                value=str(vocab_size),
                valid=(">= 258",),
            )
        h = hashlib.sha256(f"{tokenizers.__version__}|{vocab_size}".encode())
        for t in texts:
            h.update(t.encode("utf-8"))
            h.update(b"\0")
        path = (cache_dir or _cache_dir()) / f"bpe-{vocab_size}-{h.hexdigest()[:16]}.json"
        if path.is_file():
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        tok = tokenizers.Tokenizer(models.BPE())
        # No prefix space: encode/decode must round-trip any string exactly.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD, EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
        return cls(tok)


class PretrainedTokenizer(Tokenizer):
    """A Hugging Face model folder's tokenizer.json (read as data by the `tokenizers` library), with the end
    of document and padding ids its config.json names."""

    name = "pretrained"

    def __init__(self, folder: str | Path) -> None:
        """The tokenizer of `folder` (tokenizer.json, and config.json's eos_token_id/pad_token_id)."""
        import json

        import tokenizers

        self.folder = folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"tokenizer=pretrained: {folder} has no tokenizer.json; use tokenizer=bytes or bpe",
                key="tokenizer",
                value="pretrained",
                valid=("bytes", "bpe"),
            )
        self.backend = tokenizers.Tokenizer.from_file(str(file))
        config_file = folder / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos  # Llama 3 Instruct lists several; the first ends text
        if eos is None:
            raise ConfigError(
                f"tokenizer=pretrained: {folder}/config.json names no eos_token_id, which documents end with",
                key="eos_token_id",
                value="None",
                valid=("a token id",),
            )
        self.vocab_size = self.backend.get_vocab_size()
        self.eos_id = int(eos)
        pad = config.get("pad_token_id")
        self.pad_id = self.eos_id if pad is None else int(pad)  # packed LM chunks need no padding
        bos = config.get("bos_token_id")
        self.bos_id = None if bos is None else int(bos[0] if isinstance(bos, list) else bos)

    @property
    def doc_start_id(self) -> int:
        """config.json's bos_token_id (Llama's <|begin_of_text|>: what its documents began with in
        pretraining), else the end-of-document id (Qwen's folders name no BOS)."""
        return self.eos_id if self.bos_id is None else self.bos_id

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids of `text`, without the special tokens its template would add."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of many texts, in parallel in the Rust backend."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens."""
        return self.backend.decode(list(ids), skip_special_tokens=True)


class TorchtextTokenizer(Tokenizer):
    """torchtext's classic pipeline: `get_tokenizer('basic_english')`, a built vocab, `VocabTransform`.

    Words are lower-cased and split from punctuation, so `decode(encode(s))` is the normalised text
    (tokens joined by single spaces), and words unseen in training become <unk>.
    """

    name = "torchtext"

    def __init__(self, texts: Sequence[str], min_freq: int = 1) -> None:
        """Build the vocabulary over `texts` (specials first: <pad>=0, <eos>=1, <unk>=2)."""
        tt = import_torchtext()
        from torchtext.data.utils import get_tokenizer
        from torchtext.transforms import VocabTransform
        from torchtext.vocab import build_vocab_from_iterator

        self.split = get_tokenizer("basic_english")
        self.vocab = build_vocab_from_iterator(
            (self.split(t) for t in texts), min_freq=min_freq, specials=[PAD, EOS, UNK], special_first=True
        )
        self.vocab.set_default_index(self.vocab[UNK])
        self.to_ids = VocabTransform(self.vocab)
        self.vocab_size = len(self.vocab)
        self.pad_id, self.eos_id = self.vocab[PAD], self.vocab[EOS]
        self.version = tt.__version__

    def encode(self, text: str) -> list[int]:
        """Vocabulary ids of the basic_english tokens of `text`."""
        return self.to_ids(self.split(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`VocabTransform` applied to a batch of token lists at once."""
        return self.to_ids([self.split(t) for t in texts])

    def decode(self, ids: Sequence[int]) -> str:
        """Tokens joined by single spaces."""
        return " ".join(self.vocab.lookup_tokens([i for i in ids if i not in (self.pad_id, self.eos_id)]))


def import_torchtext() -> object:
    """Import torchtext, or raise the one-line ConfigError that says how to get the legacy stack."""
    try:
        import torchtext
    # Not only ImportError: torchtext built for another torch fails with OSError loading its C++ ops.
    except Exception as e:
        raise ConfigError(
            f"tokenizer=torchtext needs torchtext 0.18, which loads only against torch 2.3 (this is torch "
            f"{torch.__version__}; {type(e).__name__} on import); use tokenizer=bytes or bpe, or the legacy"
            " profile: `make test-legacy` builds it, or pip install -c constraints-legacy.txt torch"
            " torchtext",
            key="tokenizer",
            value="torchtext",
            valid=("bytes", "bpe"),
        ) from None
    torchtext.disable_torchtext_deprecation_warning()  # its end of life is why this profile exists
    return torchtext


def check_tokenizer(name: str) -> None:
    """Fail now, with one line, for a tokenizer that is unknown or cannot load here; fit nothing."""
    if name not in TOKENIZERS:
        raise unknown_choice("tokenizer", name, TOKENIZERS)
    if name == "torchtext":
        import_torchtext()


@dataclass(frozen=True)
class TokenizerSpec:
    """A task's tokenizer setting, checked when made (`check_tokenizer`) and fitted later (`fit`)."""

    name: str
    bpe_vocab_size: int
    folder: str = ""  # tokenizer=pretrained: the model.weights folder holding tokenizer.json

    def __post_init__(self) -> None:
        check_tokenizer(self.name)
        if self.name == "pretrained" and not self.folder:
            raise ConfigError(
                "tokenizer=pretrained reads the tokenizer.json of model.weights=DIR; set model.weights",
                key="model.weights",
                value="",
                valid=("a Hugging Face model folder",),
            )

    def fit(self, texts: Sequence[str]) -> Tokenizer:
        """The tokenizer, fitted on `texts` where it learns a vocabulary."""
        return build_tokenizer(self.name, texts, bpe_vocab_size=self.bpe_vocab_size, folder=self.folder)


def build_tokenizer(
    name: str,
    texts: Sequence[str],
    *,
    bpe_vocab_size: int = 2048,
    cache_dir: Path | None = None,
    folder: str = "",
) -> Tokenizer:
    """The tokenizer `name`, fitted on `texts` where it learns a vocabulary (`folder`: pretrained's)."""
    check_tokenizer(name)
    if name == "bytes":
        return ByteTokenizer()
    if name == "bpe":
        return BPETokenizer.train(texts, bpe_vocab_size, cache_dir)
    if name == "pretrained":
        return PretrainedTokenizer(folder)
    return TorchtextTokenizer(texts)


def _cache_dir() -> Path:
    return cache_root() / "tokenizers"


def tokenizer_hash(tok: Tokenizer) -> str:
    """SHA-256 of what decides a tokenizer's ids: its kind, special ids and (subword tokenizers) its rules, so
    data tokenized by one is never read by a run of another."""
    backend = getattr(tok, "backend", None)
    rules = backend.to_str() if backend is not None else ""
    head = f"{tok.name}|{tok.vocab_size}|{tok.pad_id}|{tok.eos_id}|"
    return hashlib.sha256((head + rules).encode("utf-8")).hexdigest()


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2's): printable Latin-1 bytes stand for themselves,
    the other 68 take the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_backend() -> object:
    """ByteTokenizer as a `tokenizers.Tokenizer`: byte-level, no merges, byte b is id b, then PAD (256) and
    EOS (257); what the tokenizer.json of an exported bytes run holds."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()} | {
        PAD: ByteTokenizer.pad_id,
        EOS: ByteTokenizer.eos_id,
    }
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD, EOS])
    return backend


def write_hf_tokenizer(
    tok: Tokenizer, folder: str | Path, *, context: int, chat_template: str | None = None
) -> dict[str, int]:
    """Write `tok` into the Hugging Face folder `folder` as transformers' AutoTokenizer reads it; the token
    ids config.json should name (none where `tok` came from a folder whose config.json names them).

    pretrained: the source folder's HF_TOKENIZER_FILES, copied as they are. bytes and bpe: tokenizer.json (its
    post-processor leads a text with the document start, as the run's documents began) and a
    tokenizer_config.json naming the special tokens and `context`. `chat_template` (the run's, for a chat
    fine-tune) goes into tokenizer_config.json unless the folder brings its own. torchtext has no Hugging
    Face form: ConfigError naming the tokenizer.
    """
    import tokenizers
    from tokenizers import processors

    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    ids: dict[str, int] = {}
    if isinstance(tok, PretrainedTokenizer):
        if tok.folder.resolve() != folder.resolve():  # written into its own folder: the files are there
            for name in HF_TOKENIZER_FILES:
                if (tok.folder / name).is_file():
                    shutil.copyfile(tok.folder / name, folder / name)
        if chat_template is None or (folder / "chat_template.jinja").is_file():
            return ids  # (the file is not parsed: an lm run never read it, an sft run's template read it)
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if "chat_template" in config:
            return ids
    elif isinstance(tok, (ByteTokenizer, BPETokenizer)):
        source = byte_level_backend() if isinstance(tok, ByteTokenizer) else tok.backend
        backend = tokenizers.Tokenizer.from_str(source.to_str())  # a copy: the run's own stays as it is
        start = backend.id_to_token(tok.doc_start_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{start} $A", pair=f"{start} $A {start} $B", special_tokens=[(start, tok.doc_start_id)]
        )
        backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": start,
            "eos_token": backend.id_to_token(tok.eos_id),
            "pad_token": backend.id_to_token(tok.pad_id),
            "model_max_length": context,
            "clean_up_tokenization_spaces": False,
        }
        ids = {"bos_token_id": tok.doc_start_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    else:
        raise ConfigError(
            f"tokenizer={tok.name} has no Hugging Face form; train with tokenizer=bytes, bpe or pretrained",
            key="tokenizer",
            value=tok.name,
            valid=("bytes", "bpe", "pretrained"),
        )
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return ids


#: where a run keeps a vocabulary it learned (tokenizer=bpe), beside its config and weights
RUN_TOKENIZER = "tokenizer.json"


def save_run_tokenizer(tok: Tokenizer, run_dir: Path) -> None:
    """A learned vocabulary (bpe) into `run_dir`/RUN_TOKENIZER, atomically (every rank writes the same
    bytes); bytes and pretrained tokenizers learn nothing from the data and write nothing."""
    if isinstance(tok, BPETokenizer):
        write_text_atomic(Path(run_dir) / RUN_TOKENIZER, tok.backend.to_str())


def saved_run_tokenizer(run_dir: Path, spec: TokenizerSpec) -> Tokenizer | None:
    """The bpe tokenizer a run saved (`save_run_tokenizer`); None where `spec` learns nothing or the run is
    from before runs saved it."""
    file = Path(run_dir) / RUN_TOKENIZER
    if spec.name != "bpe" or not file.is_file():
        return None
    import tokenizers

    return BPETokenizer(tokenizers.Tokenizer.from_file(str(file)))


def check_same_tokenizer(tok: Tokenizer, run_tok: Tokenizer | None, where: str) -> None:
    """ConfigError naming `tokenizer` unless `tok` (what `where` was prepared with) is the run's own
    `run_tok` (None: nothing to compare with)."""
    if run_tok is not None and tokenizer_hash(tok) != tokenizer_hash(run_tok):
        raise ConfigError(
            f"{where} was prepared with another {tok.name} tokenizer than the run trained with (its "
            f"{RUN_TOKENIZER}); prepare the data again with the run's tokenizer",
            key="tokenizer",
            value=tok.name,
        )
