"""A GGUF file's tokenizer, built from its metadata and kept on disk as Hugging Face files.

A GGUF holds no `tokenizer.json`: the vocabulary, merges, token kinds, special ids and chat
template are metadata under llama.cpp's key names. Byte-level BPE vocabularies (`gpt2`: Llama 3,
Qwen, SmolLM, ...) are rebuilt here with `tokenizers`, splitting text as llama.cpp does for the
file's `tokenizer.ggml.pre` (an unknown one is refused rather than guessed); other kinds
(sentencepiece `llama`, ...) go through transformers' GGUF reader. Either way the result is
saved once under `<cache>/gguf-tokenizers/<digest>/` and read back by mlx-lm's own tokenizer
loader, so streaming detokenizers, tool-call parsers and the chat template are chosen exactly
as for a model directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer_dir
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.model.gguf.format import GGUFFile
from protocols.errors import ModelLoadError

# Bumped when the files built here change, so caches of older builds are not reused.
BUILD_VERSION = 1
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token kinds

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer types (llama-vocab.cpp) -> the regexes it splits text with, in order.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe", "chatglm-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"), (_QWEN2,)),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
}
# Types for which llama.cpp looks a whole pre-token up in the vocabulary before merging.
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3"))


def tokenizer_digest(file: GGUFFile) -> str:
    """Identity of the tokenizer the file describes: its `tokenizer.*` metadata."""
    h = hashlib.sha256(f"gguf-tokenizer/{BUILD_VERSION}".encode())
    for key in sorted(k for k in file.metadata if k.startswith("tokenizer.")):
        value = file.metadata[key]
        h.update(key.encode() + b"\0" + repr(value.tolist() if hasattr(value, "tolist") else value).encode(errors="surrogateescape") + b"\0")
    return h.hexdigest()


def load_tokenizer(
    file: GGUFFile, cache_root: Path, *, eos_token_ids: list[int], defaults: dict[str, Any] | None, progress: Callable[[str], None] | None = None
) -> TokenizerWrapper:
    """The file's tokenizer (built and saved under `cache_root` the first time)."""
    directory = Path(cache_root) / "gguf-tokenizers" / tokenizer_digest(file)[:32]
    if not (directory / "tokenizer.json").is_file():
        if progress:
            progress(f"building the tokenizer from {file.path.name}'s metadata (once)")
        try:
            built = _build(file)
        except ModelLoadError:
            raise
        except Exception as exc:  # the tokenizers library refusing what the checks let through
            raise ModelLoadError(f"{file.path}: its tokenizer metadata does not make a tokenizer: {type(exc).__name__}: {exc}") from exc
        _save_atomically(built, directory)
    try:
        return load_tokenizer_dir(directory, eos_token_ids=eos_token_ids, defaults=defaults)
    except Exception as exc:  # a damaged cache entry: built again next time
        shutil.rmtree(directory, ignore_errors=True)
        raise ModelLoadError(f"{file.path}: the tokenizer built from its metadata does not load: {type(exc).__name__}: {exc}") from exc


def _build(file: GGUFFile):
    """A transformers fast tokenizer for the file."""
    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{file.path}: no tokenizer.ggml.tokens in the GGUF metadata")
    if kind != "gpt2":
        return _transformers_tokenizer(file)
    from transformers import PreTrainedTokenizerFast

    special = {name: _token(file, tokens, f"tokenizer.ggml.{key}") for name, key in _SPECIAL.items()}
    backend = _byte_level(file, tokens, special["bos_token"] if meta.get("tokenizer.ggml.add_bos_token") is True else None)
    template = meta.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template if isinstance(template, str) else None,
        clean_up_tokenization_spaces=False,
        **{name: token for name, token in special.items() if token is not None},
    )


_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _token(file: GGUFFile, tokens: list[str], key: str) -> str | None:
    index = file.metadata.get(key)
    if index is None:
        return None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tokens):
        raise ModelLoadError(f"{file.path}: GGUF metadata {key} = {index!r} is not a token id")
    return tokens[index]


def _byte_level(file: GGUFFile, tokens: list[str], bos: str | None) -> Tokenizer:
    meta = file.metadata
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{file.path}: GGUF pre-tokenizer {pre!r} is unknown (known: {', '.join(sorted(PRE_TOKENIZERS))}); its text would be split wrongly"
        )
    merges = meta.get("tokenizer.ggml.merges", [])
    kinds = meta.get("tokenizer.ggml.token_type", np.zeros(0, np.int32))
    if not isinstance(merges, list):  # (a list is a GGUF array of strings)
        raise ModelLoadError(f"{file.path}: GGUF metadata tokenizer.ggml.merges is {type(merges).__name__}, expected an array of strings")
    if not isinstance(kinds, np.ndarray) or kinds.dtype.kind not in "iu":
        raise ModelLoadError(f"{file.path}: GGUF metadata tokenizer.ggml.token_type is {type(kinds).__name__}, expected an array of integers")
    _check_utf8(file, tokens, "tokenizer.ggml.tokens")
    _check_utf8(file, merges, "tokenizer.ggml.merges")
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ModelLoadError(f"{file.path}: GGUF merges must be pairs of tokens separated by one space")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{file.path}: the GGUF vocabulary lists a token twice")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES))
    splits = PRE_TOKENIZERS[pre]
    steps: list[pre_tokenizers.PreTokenizer]
    if splits[-1] == _GPT2:  # ByteLevel's own regex is GPT-2's
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits[:-1]]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=k == CONTROL, normalized=False) for t, k in zip(tokens, kinds.tolist()) if k in (CONTROL, USER_DEFINED)])
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return backend


def _check_utf8(file: GGUFFile, strings: list[str], key: str) -> None:
    """A byte-level vocabulary is printable text: bytes that are not UTF-8 (kept as surrogates
    by the reader) mean a damaged file, which the tokenizers library would refuse untyped."""
    for i, text in enumerate(strings):
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:
                raise ModelLoadError(f"{file.path}: GGUF metadata {key}[{i}] is not UTF-8 text") from None


def _transformers_tokenizer(file: GGUFFile):
    """Sentencepiece and other vocabularies: transformers' own GGUF tokenizer reader."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name, local_files_only=True)
    except Exception as exc:
        kind = file.metadata.get("tokenizer.ggml.model")
        raise ModelLoadError(f"{file.path}: cannot build its {kind!r} tokenizer: {type(exc).__name__}: {exc}") from exc


def _save_atomically(tokenizer, directory: Path) -> None:
    """Write the tokenizer files to a fresh directory, then move it into place (a concurrent
    builder of the same tokenizer may win: its files are the same)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        (staging / "mlxrt-gguf.json").write_text(json.dumps({"build_version": BUILD_VERSION}))
        try:
            os.rename(staging, directory)
        except OSError:
            if not (directory / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
