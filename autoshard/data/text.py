"""Text corpora: documents read through Hugging Face `datasets`, tokenized by a local `tokenizers`
tokenizer with its EOS token after each document, and cached on disk keyed by content.

A document is a `.txt` file, a `.jsonl`/`.json` record's `text` field, or a `.parquet` row's `text`
column, and it is text: a special token's string inside it (`<|endoftext|>`) is spelled out like any
other text, never read as that token, so the only EOS ids are those put between documents. Each text
file is tokenized once into `<cache>/<key>.<dtype>.bin`, the key a hash of the file's bytes, the
tokenizer file, its EOS id and the rules here (CACHE_VERSION): a restart, another run or a rank
beside it reuses the file. The file's header records its token count and a digest of its tokens,
checked on every use: a damaged entry (truncated, overwritten) is tokenized again, said on stderr.
Ranks on one host that start together wait on a file lock while the first tokenizes; the file
appears complete (renamed) or not at all, and the temporary file of a tokenizer that was killed is
removed by the next one to tokenize into that cache. Needs `pip install 'autoshard[data]'`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.options import UsageError

INSTALL = "pip install 'autoshard[data]'"
CACHE_VERSION = b"autoshard-tokens-v2"  # v2: special tokens in text are text; a header with count and digest
CACHE_MAGIC = b"ASTOKv2\0"
CACHE_HEADER = struct.Struct("<8sQI4x32s8x")  # magic, token count, bytes per token, sha256 of the tokens
# tried in order when no config names the EOS token: GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma, others
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
ANNOUNCE_BYTES = 8 << 20  # a text file this large says it is being tokenized (a smaller one takes a moment)
LONG_DOCUMENT = 8 << 20  # characters: longer documents are tokenized in pieces cut at line starts


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers` tokenizer from a local tokenizer.json, with its EOS id and vocabulary size
    (the highest id + 1, added tokens included)."""

    file: Path
    tokenizer: Any
    eos_id: int
    vocab_size: int
    digest: str  # of tokenizer.json's bytes and the EOS id: part of every cache key

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2" if self.vocab_size <= 2**16 else "<u4")


def load_tokenizer(spec: str) -> Tokenizer:
    """`--tokenizer PATH`: a tokenizer.json, or a (Hugging Face model) directory holding one."""
    path = Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no tokenizer.json" if path.is_dir() else "no such file or directory"
        raise UsageError(f"--tokenizer {spec}: {where} (a tokenizer.json or a model directory with one)")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise UsageError(f"--tokenizer needs the tokenizers library: {INSTALL}") from None
    try:
        tokenizer = HFTokenizer.from_file(str(file))
    except Exception as err:  # the Rust library's own exception type
        raise UsageError(f"--tokenizer {spec}: not a tokenizers tokenizer.json ({err})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = _eos_id(tokenizer, file.parent)
    if eos is None:
        raise UsageError(
            f"--tokenizer {spec}: no EOS token to put between documents (none in tokenizer_config.json, "
            f"config.json or generation_config.json, and none of {', '.join(EOS_NAMES)} in the vocabulary)"
        )
    digest = hashlib.sha256(file.read_bytes() + f"\neos={eos}".encode()).hexdigest()
    return Tokenizer(file, _ordinary(tokenizer, eos), eos, max(vocab.values()) + 1, digest)


def _ordinary(tokenizer: Any, eos: int) -> Any:
    """The tokenizer reading text as text, as nanoGPT's `encode_ordinary`: special tokens' strings
    in a document are encoded like any text (`encode_special_tokens`), the EOS token's too when
    the tokenizer lists it as a plain added token. Else a document that quotes `<|endoftext|>`
    would be cut in two where it should not, its halves trained as separate documents."""
    added = tokenizer.get_added_tokens_decoder()
    if eos in added and not added[eos].special:
        config = json.loads(tokenizer.to_str())
        for token in config.get("added_tokens", []):
            token["special"] = token["special"] or token["id"] == eos
        tokenizer = type(tokenizer).from_str(json.dumps(config))
    tokenizer.encode_special_tokens = True
    return tokenizer


def _eos_id(tokenizer: Any, folder: Path) -> int | None:
    """The EOS id its model directory names (tokenizer_config.json, special_tokens_map.json,
    generation_config.json, config.json), else a well-known EOS token's."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _json(folder / name).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    for name in ("generation_config.json", "config.json"):
        found = _json(folder / name).get("eos_token_id")
        found = found[0] if isinstance(found, list) and found else found
        if isinstance(found, int) and not isinstance(found, bool) and tokenizer.id_to_token(found) is not None:
            return found
    for token in EOS_NAMES:
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_files(spec: str | None) -> dict[str, str]:
    """The tokenizer's files that a Hugging Face model directory carries (name -> text), for export:
    none without a tokenizer, or when its file has gone since training."""
    path = Path(spec).expanduser() if spec else None
    if path is None or not (path / "tokenizer.json" if path.is_dir() else path).is_file():
        return {}
    folder = path if path.is_dir() else path.parent
    files = {"tokenizer.json": (folder / "tokenizer.json" if path.is_dir() else path).read_text()}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            files[name] = (folder / name).read_text()
    if "tokenizer_config.json" not in files:  # a bare tokenizer.json: what AutoTokenizer needs beside it
        tokenizer = load_tokenizer(str(spec))
        eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
    return files


def default_cache() -> Path:
    """~/.cache/autoshard/tokens (or under $XDG_CACHE_HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoshard" / "tokens"


def tokenized(path: Path, tokenizer: Tokenizer, cache: Path) -> np.ndarray:
    """The tokens of text file `path` (EOS after each document) as a read-only memory map,
    tokenized now unless the cache holds them, checked (`_damage`): a damaged entry is rebuilt."""
    digest = hashlib.sha256(CACHE_VERSION + tokenizer.digest.encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    dtype = tokenizer.dtype
    target = cache / f"{digest.hexdigest()[:40]}.{dtype.name}.bin"
    if _damage(target, dtype) is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with open(cache / f"{target.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
                damage = _damage(target, dtype)  # another rank may have written it meanwhile
                if damage is not None:
                    _remove_stale_temps(cache, target)
                    if damage != "missing":
                        print(
                            f"autoshard data: the token cache {target} is {damage}: tokenizing {path} again",
                            file=sys.stderr,
                        )
                    _tokenize(path, tokenizer, target)
        except OSError as err:
            raise UsageError(f"cannot write the token cache {cache} ({err}); choose another --data-cache") from None
    count = _header(target)[1]
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(target, dtype=dtype, mode="r", offset=CACHE_HEADER.size, shape=(count,))


def _header(target: Path) -> tuple:
    with open(target, "rb") as f:
        return CACHE_HEADER.unpack(f.read(CACHE_HEADER.size).ljust(CACHE_HEADER.size, b"\0"))


def _damage(target: Path, dtype: np.dtype) -> str | None:
    """None when the cache file `target` is whole: its header's token count fills the file and
    its tokens have the header's digest; else what is wrong ("missing", "truncated ...").
    Reads the file once (sha256 at ~1.5 GB/s), on every use: a cache is trusted for no more
    than existing."""
    try:
        size = target.stat().st_size
        magic, count, itemsize, want = _header(target)
        if magic != CACHE_MAGIC or itemsize != dtype.itemsize:
            return "not a token cache file of this version"
        if size != CACHE_HEADER.size + count * itemsize:
            return f"truncated ({size - CACHE_HEADER.size} bytes of tokens where its header says {count * itemsize})"
        digest = hashlib.sha256()
        with open(target, "rb") as f:
            f.seek(CACHE_HEADER.size)
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"unreadable ({err})"
    return None if digest.digest() == want else "damaged (its tokens do not have its header's digest)"


def _remove_stale_temps(cache: Path, target: Path) -> None:
    """The temporary files that killed tokenizers left in `cache` (SIGKILL, or a SIGTERM nothing
    handled, skip the clean-up): `target`'s, whose lock the caller holds, and any other whose
    lock is free. A running tokenizer holds its target's lock, so its file stays."""
    for tmp in cache.glob(".*.tmp"):
        name = tmp.name[1:].rsplit(".", 2)[0]  # .<target name>.<pid>.tmp
        try:
            if name != target.name:
                with open(cache / f"{name}.lock", "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tmp.unlink(missing_ok=True)
        except OSError:  # its tokenizer is at work (the lock is taken)
            continue


def _tokenize(path: Path, tokenizer: Tokenizer, target: Path) -> None:
    """Tokenize into a temporary file, its header (count, digest) written last, then renamed."""
    size = path.stat().st_size
    if size >= ANNOUNCE_BYTES:  # stderr, not the log: logging is set up later; this may take minutes
        print(f"autoshard data: tokenizing {path} ({size / 1e6:.0f} MB) once, into {target}", file=sys.stderr)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, count = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, tempfile.TemporaryDirectory(prefix="autoshard-datasets-") as scratch:
            out.write(bytes(CACHE_HEADER.size))
            for ids in _encoded(path, tokenizer, scratch):
                digest.update(ids.tobytes())
                out.write(ids.tobytes())
                count += len(ids)
            out.seek(0)
            out.write(CACHE_HEADER.pack(CACHE_MAGIC, count, tokenizer.dtype.itemsize, digest.digest()))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _encoded(path: Path, tokenizer: Tokenizer, scratch: str) -> Iterator[np.ndarray]:
    """Each document's tokens and the EOS after it, encoded 256 pieces to a batch. An EOS id
    inside a document is an error: the tokenizer's model spells it from text (`_ordinary` keeps
    the added and special tokens from doing so), and the document would be cut in two."""
    eos, dtype = tokenizer.eos_id, tokenizer.dtype
    for group in _groups(documents(path, scratch), 256):
        encodings = iter(tokenizer.tokenizer.encode_batch([p for doc in group for p in doc], add_special_tokens=False))
        for doc in group:
            ids = np.concatenate([np.asarray(next(encodings).ids, dtype) for _ in doc] + [np.array([eos], dtype)])
            if np.count_nonzero(ids == eos) > 1:
                raise UsageError(
                    f"{path}: --tokenizer reads the text {tokenizer.tokenizer.id_to_token(eos)!r} in a document "
                    f"as its EOS token {eos}, which must only end a document (its model has that string as a "
                    "piece of text): take the string out of the text, or use another tokenizer"
                )
            yield ids


def _groups(docs: Iterator[str], size: int) -> Iterator[list[list[str]]]:
    """Documents, each as its pieces (`pieces`), in groups of about `size` pieces: one batch to encode."""
    group: list[list[str]] = []
    for doc in docs:
        group.append(pieces(doc))
        if sum(map(len, group)) >= size:
            yield group
            group = []
    if group:
        yield group


def pieces(text: str, longest: int = LONG_DOCUMENT) -> list[str]:
    """A document cut at line starts into pieces of at most `longest` characters (a line longer than
    that: at `longest`), so that one huge file is not one huge encoding; a tokenizer may split the
    text at a cut slightly otherwise than it would have."""
    out, start = [], 0
    while len(text) - start > longest:
        cut = text.rfind("\n", start, start + longest) + 1
        cut = cut if cut > start else start + longest
        out.append(text[start:cut])
        start = cut
    return [*out, text[start:]]


def documents(path: Path, scratch: str | None = None) -> Iterator[str]:
    """The non-empty documents of a text file, read through `datasets` (streamed: no arrow copy;
    the lock files streaming leaves go to `scratch`, not the Hugging Face cache, when given)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"text data ({path.name}) needs Hugging Face datasets: {INSTALL}") from None
    suffix = path.suffix.lower()
    builder, options = {".txt": ("text", {"sample_by": "document"}), ".parquet": ("parquet", {})}.get(
        suffix, ("json", {})
    )
    try:
        rows = datasets.load_dataset(
            builder, data_files=[str(path)], split="train", streaming=True, cache_dir=scratch, **options
        )
        for i, row in enumerate(rows):
            text = row.get("text")
            if not isinstance(text, str):
                raise UsageError(
                    f"{path}: record {i} has no text field (its fields: {', '.join(map(str, row)) or 'none'}); "
                    "autoshard reads each record's `text`"
                )
            if text:
                yield text
    except UsageError:
        raise
    except Exception as err:  # datasets, pyarrow and json each raise their own kinds
        raise UsageError(f"{path}: cannot read it as {builder} ({type(err).__name__}: {err})") from None
