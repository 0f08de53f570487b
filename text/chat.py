"""Chat conversations for supervised fine-tuning (`+task=sft`): read from JSONL files of
`{"messages": [{"role": ..., "content": ...}, ...]}` (the layout transformers, TRL and torchtitan read), or
the embedded KJV questions; rendered with a chat template and tokenized with a mask of the tokens the loss
is on (the assistant's).

A template is Jinja source as Hugging Face folders ship it (tokenizer_config.json's `chat_template`, or a
chat_template.jinja file), rendered as transformers renders it: a sandboxed environment (a template in a
downloaded folder reaches no Python internals, so it runs no code), trim_blocks and lstrip_blocks, the loop
controls extension, `raise_exception`; the variables messages, add_generation_prompt, bos_token, eos_token.
A tokenizer without one (bytes, bpe, a folder without a template) gets ChatML, the format Qwen's templates
write.

The assistant's spans come from rendering prefixes of the conversation: assistant message i is what
rendering messages[:i+1] adds to rendering messages[:i] with the generation prompt. Each piece is tokenized
on its own, so the prompt a model is given at generation time (the messages before an assistant turn, and
the generation prompt) tokenizes exactly as it did in training.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from core.bounds import Bounds
from core.data.bad_samples import DEFAULT_POLICY, BadSamplePolicy, BadSamples
from core.data.jsonl import read_jsonl
from core.errors import DataError
from core.registry import DATASETS
from text.corpus import in_validation, kjv_verses
from text.tokenizer import Tokenizer

T = TypeVar("T")

ROLES = ("system", "user", "assistant")
#: one conversation: messages with a `role` (ROLES) and a string `content`
Conversation = list[dict[str, str]]

#: ChatML, the turn format of Qwen's own templates, for tokenizers that bring no template
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ChatCorpus:
    """Training and validation conversations."""

    train: list[Conversation]
    val: list[Conversation]


class ChatTemplate:
    """A Jinja chat template, compiled in a sandbox; `render` gives a conversation's text."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "ChatML"
    ) -> None:
        """Compile `source`; `origin` names where it came from in errors (a file, or ChatML)."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DataError(f"the chat template of {origin} refused a conversation: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_blocks()]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise DataError(
                f"the chat template of {origin} is not valid Jinja: {e}", key="chat_template"
            ) from None
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The text of `messages`; the assistant's turn opened after them when `add_generation_prompt`."""
        import jinja2

        try:
            return self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:  # the sandbox's SecurityError among them
            raise DataError(f"the chat template of {self.origin} failed: {e}", key="chat_template") from None

    def end_of_turn(self) -> str:
        """The text the template puts after an assistant message's content (ChatML: `<|im_end|>`): where a
        generated answer ends."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
        head = self.render(probe[:1], add_generation_prompt=True)
        piece = self.render(probe)[len(head) :]
        return piece.partition("\x00")[2].strip()

    def pieces(self, messages: Conversation) -> list[tuple[str, bool]]:
        """`messages`' text in order as (piece, is the assistant's): each assistant message's own text (its
        content and end of turn) between the rest. DataError when the template renders a conversation's
        earlier turns differently once later ones follow (the prefixes would not line up)."""
        out: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (head.startswith(done) and upto.startswith(head)):
                raise DataError(
                    f"the chat template of {self.origin} renders a conversation's earlier turns differently "
                    "once later ones follow, so its assistant turns cannot be told apart; give the "
                    "conversation one assistant turn, at its end",
                    key="chat_template",
                )
            out += [(head[len(done) :], False), (upto[len(head) :], True)]
            done = upto
        return out

    @classmethod
    def of_folder(cls, folder: str | Path) -> ChatTemplate:
        """The template of a Hugging Face folder (chat_template.jinja, or tokenizer_config.json's
        `chat_template`: a string, or a list of named ones whose `default` is taken); ChatML without one."""
        folder = Path(folder)
        config_file = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except (ValueError, OSError) as e:  # not JSON, not UTF-8, unreadable: one line naming the file
            raise DataError(
                f"{config_file}: not a readable JSON file ({type(e).__name__})", key="chat_template"
            ) from None
        if not isinstance(config, dict):
            raise DataError(
                f"{config_file}: a JSON {type(config).__name__}, not an object", key="chat_template"
            )
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), origin=str(jinja), **special)
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if isinstance(source, str):
            return cls(source, origin=str(config_file), **special)
        return cls(CHATML, **special)


def _generation_blocks() -> type:
    """A Jinja extension that renders `{% generation %}...{% endgeneration %}` (the tags some templates put
    around assistant text for transformers' assistant masks) as its body: the spans come from prefixes."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationBlocks


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an added token's {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def encode_conversation(
    messages: Conversation, template: ChatTemplate, tok: Tokenizer
) -> tuple[list[int], list[bool]]:
    """(ids, which ids the loss is on) of one conversation: its pieces (`ChatTemplate.pieces`) tokenized each
    on its own, after the id every packed document starts with (`Tokenizer.doc_start_id`) unless the
    template wrote that itself (Llama 3's `{{ bos_token }}`)."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, assistant in template.pieces(messages):
        piece = tok.encode(text)
        ids += piece
        mask += [assistant] * len(piece)
    started = _started(ids, tok)
    return started, [False] * (len(started) - len(ids)) + mask  # the added start id is not trained


def prompt_ids(messages: Conversation, template: ChatTemplate, tok: Tokenizer) -> list[int]:
    """The ids a model continues to answer after `messages` (which end before an assistant turn): their
    pieces tokenized as `encode_conversation` tokenizes them in training, then the generation prompt."""
    pieces = template.pieces(messages)
    done = "".join(text for text, _ in pieces)
    head = template.render(messages, add_generation_prompt=True)
    ids = [i for text, _ in pieces for i in tok.encode(text)] + tok.encode(head[len(done) :])
    return _started(ids, tok)


def _started(ids: list[int], tok: Tokenizer) -> list[int]:
    """`ids` after the id documents start with (`Tokenizer.doc_start_id`), unless the template wrote it
    itself (Llama 3's `{{ bos_token }}`)."""
    return ids if ids[:1] == [tok.doc_start_id] else [tok.doc_start_id, *ids]


def messages_fault(messages: Any, key: str) -> str | None:
    """Why `messages`, a row's value under `key`, is not a non-empty list of messages (None: it is one),
    naming the key at fault."""
    if not isinstance(messages, list) or not messages:
        return f"no '{key}' list"
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"{key}[{j}] is not an object"
        if m.get("role") not in ROLES:
            return f"{key}[{j}].role={m.get('role')!r} is not one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"{key}[{j}].content is not a string"
    return None


def message_fault(row: Any) -> str | None:
    """Why a JSONL row is not a conversation (None: it is one), naming the key at fault."""
    messages = row.get("messages") if isinstance(row, dict) else None
    why = messages_fault(messages, "messages")
    if why is not None:
        return why
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message (nothing to learn from)"
    return None


def read_rows(
    path: str | Path, policy: BadSamplePolicy, fault: Callable[[Any], str | None], layout: str, noun: str
) -> list[dict[str, Any]]:
    """The rows of a JSONL file of `layout` lines (`noun`: what they hold) in which `fault` finds nothing
    wrong; a line that is not one goes by `policy` (data.on_bad_sample), named path:line with `fault`'s
    reason. A missing file, or one with no good row, is a DataError naming data.train."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{path}: no such file; give a .jsonl file of {layout} lines", key="data.train")
    bad = BadSamples(policy, str(p), noun)
    out = []
    for line, row in read_jsonl(p, bad.add):
        why = fault(row)
        if why is None:
            out.append(row)
        else:
            bad.add(f"{p}:{line}", why)
    bad.check(len(out) + len(bad.found))
    if not out:
        raise DataError(f"{p} holds no {noun}", key="data.train", value=str(p))
    return out


def read_conversations(path: str | Path, policy: BadSamplePolicy = DEFAULT_POLICY) -> list[Conversation]:
    """The conversations of a JSONL file, one `{"messages": [...]}` object a line; a line that is not one
    goes by `policy` (data.on_bad_sample), named path:line with what is wrong."""
    rows = read_rows(path, policy, message_fault, '{"messages": [...]}', "conversations")
    return [[{"role": m["role"], "content": m["content"]} for m in row["messages"]] for row in rows]


def split_examples(
    train: str,
    val: str,
    val_fraction: float,
    embedded: Callable[[], list[tuple[str, T]]],
    read: Callable[[str], list[T]],
) -> tuple[list[T], list[T]]:
    """(training, validation) examples: `read` from the `train` file and the `val` file (none: the last
    `val_fraction` of train's, in file order), or with no `train` the `embedded` (reference, example)
    pairs, split by a hash of the reference (`text.corpus.in_validation`)."""
    if not train:
        if val:
            raise DataError(
                "data.val names a file but data.train is empty; give both, or neither", key="data.train"
            )
        pairs = embedded()
        return (
            [m for ref, m in pairs if not in_validation(ref, val_fraction)],
            [m for ref, m in pairs if in_validation(ref, val_fraction)],
        )
    examples = read(train)
    if val:
        return examples, read(val)
    cut = len(examples) - max(1, round(len(examples) * val_fraction))
    if cut < 1:
        raise DataError(
            f"{train} holds {len(examples)} example(s): too few to hold some out; give data.val",
            key="data.val",
        )
    return examples[:cut], examples[cut:]


#: the embedded questions' books: five whose verses read differently (law and narrative, song, sayings,
#: gospel, vision), so which book a held-out verse is from is learnable from its words
KJV_BOOKS = ("Genesis", "Psalms", "Proverbs", "Matthew", "Revelation")
QUESTION = "Which book holds this verse? "


def kjv_questions(per_book: int, max_chars: int, seed: int = 0) -> list[tuple[str, Conversation]]:
    """(reference, conversation) of up to `per_book` verses of each of KJV_BOOKS no longer than `max_chars`,
    each asked as "Which book holds this verse? <verse>" and answered with the book's name; a seeded pick,
    in a seeded order."""
    rng = random.Random(seed)
    out = []
    for book in KJV_BOOKS:
        verses = [v for v in kjv_verses() if v.book == book and len(v.text) <= max_chars]
        for v in rng.sample(verses, min(per_book, len(verses))):
            messages = [
                {"role": "user", "content": QUESTION + v.text},
                {"role": "assistant", "content": book},
            ]
            out.append((v.reference, messages))
    rng.shuffle(out)
    return out


@DATASETS.register("chat")
def chat(
    *,
    train: str = "",
    val: str = "",
    val_fraction: Annotated[float, Bounds(gt=0, lt=1)] = 0.1,
    per_book: Annotated[int, Bounds(ge=1)] = 400,
    max_chars: Annotated[int, Bounds(ge=1)] = 150,
    policy: BadSamplePolicy = DEFAULT_POLICY,
) -> ChatCorpus:
    """Conversations for chat fine-tuning: JSONL files of {"messages": [{"role", "content"}, ...]}, or with no
    `train` the embedded KJV questions ("Which book holds this verse? ..." of five books, split by a hash of
    the verse's reference).

    train: the training conversations, .jsonl (empty: the embedded KJV questions)
    val: the validation conversations, .jsonl (empty: the last val_fraction of train's, in file order)
    val_fraction: the share held out for validation when no `val` file is given
    per_book: the embedded questions: verses asked about per book
    max_chars: the embedded questions: longest verse asked about, in characters
    """
    return ChatCorpus(
        *split_examples(
            train,
            val,
            val_fraction,
            lambda: kjv_questions(per_book, max_chars),
            lambda path: read_conversations(path, policy),
        )
    )
