"""The built-in models' tokenizer: corpus, BPE training, special tokens, chat template.

This module owns what the tokenizer *is* (a byte-level BPE trained deterministically
on a fixed slice of the Python standard library, plus ChatML special tokens and a
Qwen2.5-style chat template) and the Hugging Face files that describe it. Caching
the trained result on disk is the caller's job (see ``engine.builtin.models``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML control tokens: special, so `skip_special_tokens` drops them.
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Markup tokens stay visible in decoded text (as in Qwen2.5/Qwen3) so that tool-call
# and reasoning parsers can find them even when special tokens are skipped.
MARKUP_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<think>", "</think>")
ADDED_TOKENS: tuple[str, ...] = CONTROL_TOKENS + MARKUP_TOKENS
EOS_TOKENS: tuple[str, ...] = (IM_END, ENDOFTEXT)

# Fixed, sorted list of stdlib sources, ~4 MB on CPython 3.11. Files that a given Python
# lacks are skipped, so the trained vocabulary may differ between Python versions.
CORPUS_FILES: tuple[str, ...] = tuple(
    sorted(
        (
            "_pydecimal.py",
            "argparse.py",
            "ast.py",
            "asyncio/base_events.py",
            "bisect.py",
            "calendar.py",
            "collections/__init__.py",
            "configparser.py",
            "contextlib.py",
            "copy.py",
            "csv.py",
            "dataclasses.py",
            "datetime.py",
            "difflib.py",
            "doctest.py",
            "email/_header_value_parser.py",
            "email/message.py",
            "enum.py",
            "fractions.py",
            "functools.py",
            "gettext.py",
            "glob.py",
            "heapq.py",
            "http/client.py",
            "http/cookiejar.py",
            "http/server.py",
            "inspect.py",
            "ipaddress.py",
            "json/decoder.py",
            "json/encoder.py",
            "locale.py",
            "logging/__init__.py",
            "mailbox.py",
            "optparse.py",
            "os.py",
            "pathlib.py",
            "pdb.py",
            "pickle.py",
            "pickletools.py",
            "pprint.py",
            "pydoc.py",
            "random.py",
            "shutil.py",
            "smtplib.py",
            "socket.py",
            "ssl.py",
            "statistics.py",
            "string.py",
            "subprocess.py",
            "tarfile.py",
            "tempfile.py",
            "textwrap.py",
            "threading.py",
            "tokenize.py",
            "traceback.py",
            "turtle.py",
            "typing.py",
            "unittest/case.py",
            "unittest/mock.py",
            "urllib/parse.py",
            "urllib/request.py",
            "xml/dom/minidom.py",
            "xml/etree/ElementTree.py",
            "zipfile.py",
        )
    )
)

CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Bump when the training recipe or file layout changes, to invalidate caches.
TOKENIZER_FORMAT = 1


def spec_digest(spec, build_format: int) -> str:
    """sha256 over a built-in's dataclass spec (its tokenizer by digest) and its build format."""
    fields = {**dataclasses.asdict(spec), "tokenizer": spec.tokenizer.digest(), "format": build_format}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What determines a trained tokenizer; `vocab_size` includes the added tokens."""

    vocab_size: int
    corpus_chars: int

    def digest(self) -> str:
        """sha256 over everything that shapes the trained tokenizer.json."""
        payload = {
            "format": TOKENIZER_FORMAT,
            "spec": dataclasses.asdict(self),
            "added_tokens": ADDED_TOKENS,
            "control_tokens": CONTROL_TOKENS,
            "corpus_files": CORPUS_FILES,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def training_corpus(corpus_chars: int) -> list[str]:
    """The training text, split into lines; files missing in this Python are skipped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / rel).read_text(encoding="utf-8") for rel in CORPUS_FILES if (stdlib / rel).is_file()]
    return "".join(texts)[:corpus_chars].splitlines(keepends=True)


def train_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Train the byte-level BPE; added tokens take the last ids of the vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(ADDED_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(training_corpus(spec.corpus_chars), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=token in CONTROL_TOKENS, normalized=False) for token in ADDED_TOKENS])
    return tokenizer


def added_token_ids(tokenizer_json: Path) -> dict[str, int]:
    """Map each added token to its id, as recorded in a tokenizer.json."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    return {entry["content"]: entry["id"] for entry in data["added_tokens"]}


def write_tokenizer_config(directory: Path, tokenizer_json: Path, model_max_length: int) -> None:
    """Write tokenizer_config.json and special_tokens_map.json next to a tokenizer.json."""
    ids = added_token_ids(tokenizer_json)
    special_map = {
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [t for t in CONTROL_TOKENS if t not in (IM_END, ENDOFTEXT)],
    }
    config = {
        **special_map,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token in CONTROL_TOKENS,
            }
            for token in ADDED_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(directory / "special_tokens_map.json", special_map)
    _write_json(directory / "tokenizer_config.json", config)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
