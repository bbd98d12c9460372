"""Optional dependencies: packages the measuring tools need and the server does not.

``jaxserve bench serve`` and ``jaxserve sweep`` need httpx (and the sweep's plots matplotlib):
the ``bench`` extra of pyproject.toml; ``jaxserve plan-autoscaling --sim-plot`` needs matplotlib:
the ``autoscaling`` extra. A tool asks for its packages with :func:`require` when it runs, before
it does any work, so importing the command (or serving) never needs them and a missing one is
one line that names the extra to install.
"""

from __future__ import annotations

import importlib
import types


class MissingExtraError(ImportError):
    """A package of an optional extra is not installed; the message says what needs it and
    which ``pip install 'jaxserve[EXTRA]'`` brings it."""


def require(module: str, extra: str, feature: str) -> types.ModuleType:
    """Import ``module`` (e.g. ``"httpx"``, ``"matplotlib"``) for ``feature``, a phrase naming
    what needs it (``"jaxserve sweep"``).

    Raises:
      MissingExtraError: ``module`` cannot be imported; the message names the extra
        (``pip install 'jaxserve[bench]'``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.partition(".")[0]
        raise MissingExtraError(f"{feature} needs {package}, which is not installed: "
                                f"pip install 'jaxserve[{extra}]'") from e
