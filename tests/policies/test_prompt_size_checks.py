"""A text prompt longer in characters than the context could hold in bytes is refused typed by
`validate` (before any tokenizing worker sees it); one at the bound passes."""

from __future__ import annotations

import pytest

from policies.validation import max_prompt_bytes, validate
from protocols.api import GenerateRequest
from protocols.config import LimitsConfig
from protocols.errors import RequestTooLargeError
from tests.support.model_info import model_info

INFO = model_info()


@pytest.mark.parametrize("limits", [LimitsConfig(), LimitsConfig(max_prompt_bytes=1000)])
def test_a_prompt_longer_than_the_byte_bound_is_refused_before_tokenizing(limits):
    limit = max_prompt_bytes(INFO, limits)
    validate(GenerateRequest(prompt="x" * limit), INFO, limits)
    with pytest.raises(RequestTooLargeError) as raised:
        validate(GenerateRequest(prompt="x" * (limit + 1)), INFO, limits)
    assert raised.value.field == "prompt" and str(limit) in str(raised.value)
