"""Instruction data: `.jsonl` records of `messages` (a chat, rendered with the tokenizer's chat
template) or of `prompt` and `completion`, each read into one example: its token ids, EOS last,
and which of them are the answer (the assistant's turns, or the completion) that
`--loss-on completion` trains on.

A record with `text` is plain text (`autoshard.data.text`); a file is one kind throughout, so a
record of another kind, or of none, is one `UsageError` naming the file and line. The chat
template is `chat_template` of the tokenizer_config.json beside tokenizer.json (Hugging Face's
layout), rendered by transformers' jinja renderer. An assistant turn's text is what rendering the
chat through that turn adds to rendering it up to the turn with the generation prompt: the
template's own turn header stays prompt, its end-of-turn token is answer. Text segments are
tokenized one at a time, so an answer's tokens are exactly the ones marked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.data.text import Tokenizer
from autoshard.options import UsageError

KINDS = ("messages", "prompt")  # instruction kinds of record: a chat, or prompt/completion


@dataclass(frozen=True)
class Example:
    """One example's token ids (int64, EOS last) and which of them are answer tokens."""

    ids: np.ndarray
    answer: np.ndarray  # bool, as ids


def record_kind(record: Any) -> str | None:
    """The record's kind: "messages", "prompt" (prompt/completion), "text", or None (neither)."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt"
    return "text" if "text" in record else None


def file_kind(path: Path) -> str | None:
    """The kind of a `.jsonl` file's first record ("text" for other files and for an empty or
    unreadable one: the text reader says what is wrong with it)."""
    if path.suffix.lower() != ".jsonl":
        return "text"
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return record_kind(json.loads(line)) or "text"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    return "text"


def records(path: Path) -> list[tuple[int, str, dict]]:
    """(line number, kind, record) of each record of an instruction `.jsonl`, all of one kind."""
    out: list[tuple[int, str, dict]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: cannot read it ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}:{number}: not a JSON record ({err.msg})") from None
        kind = record_kind(record)
        if kind is None or kind == "text":
            fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise UsageError(
                f"{path}:{number}: a record of neither `messages` nor `prompt`/`completion` (its fields: "
                f"{fields or 'none'}) in a file of {out[0][1] if out else 'instruction'} records"
                if kind is None
                else f"{path}:{number}: a `text` record in a file of instruction records: one kind per file"
            )
        if out and kind != out[0][1]:
            have, first = _NAMES[kind], _NAMES[out[0][1]]
            raise UsageError(f"{path}:{number}: a `{have}` record in a file of `{first}` records: one kind per file")
        out.append((number, kind, record))
    return out


_NAMES = {"messages": "messages", "prompt": "prompt/completion"}


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template and the special-token strings templates refer to."""

    template: str
    tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.template, self.tokens], sort_keys=True).encode()).hexdigest()


def chat_template(tokenizer_file: Path) -> ChatTemplate | None:
    """The chat template of tokenizer_config.json beside tokenizer.json (None: none there); a
    list of named templates gives its "default"."""
    path = tokenizer_file.parent / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return ChatTemplate(template, tokens)


def read_examples(path: Path, tokenizer: Tokenizer, template: ChatTemplate | None) -> list[Example]:
    """Every example of an instruction `.jsonl`, tokenized."""
    found = records(path)
    if not found:
        return []
    if found[0][1] == "messages" and template is None:
        raise UsageError(
            f"{path}: `messages` records are rendered with the tokenizer's chat template, and "
            f"{tokenizer.file.parent / 'tokenizer_config.json'} has none (`chat_template`): give a --tokenizer "
            "directory whose tokenizer_config.json has one, or write prompt/completion records"
        )
    chat = _chat_tokenizer(tokenizer)
    out = []
    for number, kind, record in found:
        where = f"{path}:{number}"
        if kind == "prompt":
            prompt, completion = record["prompt"], record["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UsageError(f"{where}: `prompt` and `completion` are strings")
            segments = [(prompt, False), (completion, True)]
            out.append(_example(segments, tokenizer.tokenizer, tokenizer.eos_id))
        else:
            assert template is not None
            out.append(_example(chat_segments(record["messages"], template, where), chat, tokenizer.eos_id))
    return out


def _chat_tokenizer(tokenizer: Tokenizer) -> Any:
    """The tokenizer reading a rendered chat: the template's special tokens are tokens there
    (`Tokenizer.tokenizer` spells them out as text, which a document needs and a template not)."""
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(tokenizer.file))


def chat_segments(messages: Any, template: ChatTemplate, where: str) -> list[tuple[str, bool]]:
    """The rendered chat as (text, is the assistant's) pieces, in order."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: `messages` is a non-empty list of {{role, content}} records")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"{where}: each message is a {{role, content}} record of strings, not {m!r:.60}")
    segments, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, where)
        through = _render(template, messages[: i + 1], False, where)
        if not (before.startswith(done) and through.startswith(before)):
            raise UsageError(
                f"{where}: the chat template does not render this chat turn by turn (a rendering up to an "
                "assistant turn is not the start of the one through it), so its answer tokens are not found"
            )
        segments += [(before[len(done) :], False), (through[len(before) :], True)]
        done = through
    rest = _render(template, messages, False, where)
    if not rest.startswith(done):
        raise UsageError(f"{where}: the chat template does not render this chat turn by turn")
    return [s for s in [*segments, (rest[len(done) :], False)] if s[0]]


def _render(template: ChatTemplate, messages: list, generation: bool, where: str) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            [messages], chat_template=template.template, add_generation_prompt=generation, **template.tokens
        )
    except Exception as err:  # jinja2's errors and the template's own raise_exception
        raise UsageError(f"{where}: the chat template fails on this chat ({type(err).__name__}: {err})") from None
    return rendered[0]


def _example(segments: list[tuple[str, bool]], tokenizer: Any, eos: int) -> Example:
    """The segments' tokens one after another and EOS, each marked as its segment (EOS as the last)."""
    encodings = tokenizer.encode_batch([text for text, _ in segments], add_special_tokens=False)
    ids = [np.asarray(e.ids, np.int64) for e in encodings] + [np.array([eos], np.int64)]
    last = bool(segments) and segments[-1][1]
    answer = [np.full(len(e.ids), flag) for e, (_, flag) in zip(encodings, segments)] + [np.array([last])]
    return Example(np.concatenate(ids), np.concatenate(answer).astype(bool))
