"""The models `builtin:<name>` names: trained models installed as packages (`packaged`:
SmolLM2-135M-Instruct, the default) and deterministic, random-weight mlx-lm model directories
for tests and benchmarks.

``ensure_builtin("tiny")`` returns a directory that ``mlx_lm.utils.load`` loads offline
(model + tokenizer with a ChatML chat template), building and caching it on first use.
``ensure_model(spec, root=...)`` does the same for any `BuiltinSpec` (any mlx-lm model
type, optionally quantized), e.g. the test suite's table of model families.
"""

from engine.builtin.catalog import BENCH_TOKENIZER, BUILTIN_MODELS, TINY_TOKENIZER, UnknownBuiltinModelError, builtin_name, ensure_builtin
from engine.builtin.fields import config_fields
from engine.builtin.models import BuiltinSpec, ensure_model, parameter_count
from engine.builtin.packaged import PACKAGED_MODELS, PackagedModelMissingError, packaged_model_path
from engine.builtin.tokenizer import TokenizerSpec

__all__ = [
    "BENCH_TOKENIZER",
    "BUILTIN_MODELS",
    "PACKAGED_MODELS",
    "TINY_TOKENIZER",
    "BuiltinSpec",
    "PackagedModelMissingError",
    "TokenizerSpec",
    "UnknownBuiltinModelError",
    "builtin_name",
    "config_fields",
    "ensure_builtin",
    "ensure_model",
    "packaged_model_path",
    "parameter_count",
]
