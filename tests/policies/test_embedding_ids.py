"""policies.embeddings on its own: the pooling and normalization a call settles on, and each
input's token ids, refused typed (naming the input) where they cannot be embedded."""

from __future__ import annotations

import pytest

from policies.embeddings import embedding_ids, embedding_options
from protocols.config import EmbeddingsConfig, LimitsConfig
from protocols.errors import InvalidRequestError, RequestTooLargeError
from protocols.model import ModelInfo

INFO = ModelInfo(
    path="m", model_type="llama", vocab_size=100, max_context=32, num_layers=1, kv_bytes_per_token=1,
    dtype="float32", device="cpu", eos_token_ids=[0], num_parameters=1, load_s=0.0, max_token_bytes=8,
)  # fmt: skip
CONFIG = EmbeddingsConfig(max_inputs=3, max_tokens=40)
LIMITS = LimitsConfig()


class Tokenizer:
    """One token per character (its code point mod 90, + 10), a BOS of 1 unless the text starts with "<s>"."""

    bos_token = "<s>"

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return ([1] if add_special_tokens else []) + [10 + ord(c) % 90 for c in text]


def test_options_default_to_the_config_and_are_checked():
    assert embedding_options(None, None, EmbeddingsConfig(pooling="mean", normalize=False)) == ("mean", False)
    assert embedding_options("last", True, EmbeddingsConfig(pooling="mean", normalize=False)) == ("last", True)
    with pytest.raises(InvalidRequestError) as bad_pooling:
        embedding_options("max", None, CONFIG)
    assert bad_pooling.value.field == "pooling"
    with pytest.raises(InvalidRequestError) as bad_normalize:
        embedding_options(None, "yes", CONFIG)
    assert bad_normalize.value.field == "normalize"


def test_texts_and_token_lists_give_their_ids_in_order():
    tokenizer = Tokenizer()
    ids = embedding_ids(["ab", [5, 6, 7], "<s>c"], tokenizer, INFO, CONFIG, LIMITS)
    assert ids == [[1, 10 + ord("a") % 90, 10 + ord("b") % 90], [5, 6, 7], [10 + ord(c) % 90 for c in "<s>c"]]
    # A text that starts with the BOS gets none added (as a completion prompt).
    assert tokenizer.calls == [("ab", True), ("<s>c", False)]


@pytest.mark.parametrize(
    "inputs,field,kind",
    [
        ([], "input", InvalidRequestError),
        ("text", "input", InvalidRequestError),
        (["a", "b", "c", "d"], "input", InvalidRequestError),  # more than max_inputs
        (["a", ""], "input[1]", InvalidRequestError),
        ([[]], "input[0]", InvalidRequestError),
        ([[1, 100]], "input[0]", InvalidRequestError),  # past the vocabulary
        ([[1, -1]], "input[0]", InvalidRequestError),
        ([[1, True]], "input[0]", InvalidRequestError),  # a bool is not a token id
        ([3.5], "input[0]", InvalidRequestError),
        (["a", list(range(1, 34))], "input[1]", RequestTooLargeError),  # over the context
        ([list(range(1, 30)), list(range(1, 13))], "input", RequestTooLargeError),  # 41 tokens > max_tokens
        (["x" * 10_000], "input[0]", RequestTooLargeError),  # refused by its bytes, before tokenizing
    ],
)
def test_what_cannot_be_embedded_is_refused_naming_the_input(inputs, field, kind):
    tokenizer = Tokenizer()
    with pytest.raises(kind) as refused:
        embedding_ids(inputs, tokenizer, INFO, CONFIG, LIMITS)
    assert refused.value.field == field
    assert all(len(text) < 10_000 for text, _ in tokenizer.calls)
