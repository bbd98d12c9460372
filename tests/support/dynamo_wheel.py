"""NVIDIA Dynamo's ForwardPassMetrics module, from its released wheel, to decode our records.

``pip install ai-dynamo==1.6.1`` fails on Python 3.12 here (its dependency ``aisimulate`` is a
stub that fetches the real wheel from NVIDIA's own index). The module that defines the record,
``dynamo/common/forward_pass_metrics.py`` (``ForwardPassMetrics``, ``encode``, ``decode``,
``WelfordAccumulator``), imports only msgspec and logging, so the released
``ai_dynamo-1.6.1-py3-none-any.whl`` (3.9 MB, sha256 checked against PyPI's, the file against
the wheel's RECORD; ``tests/support/released_wheel.py``) is downloaded once and that file runs
unmodified with the real msgspec.
"""

from __future__ import annotations

import sys
import types

from tests.support.released_wheel import Wheel, download, exec_module

DYNAMO_VERSION = "1.6.1"
WHEEL = f"ai_dynamo-{DYNAMO_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "83f768730104cbbc84029bf436025706632735173933adbb650b99c746517b70"  # PyPI's
MODULE = "dynamo/common/forward_pass_metrics.py"


def load_forward_pass_metrics() -> types.ModuleType:
    """Dynamo's ``dynamo.common.forward_pass_metrics`` module from the released wheel (kept in
    ``sys.modules`` under that name only while it runs)."""
    wheel = Wheel(download(f"ai-dynamo=={DYNAMO_VERSION}", WHEEL, WHEEL_SHA256))
    name = "dynamo.common.forward_pass_metrics"
    try:
        return exec_module(name, wheel.source(MODULE), MODULE)
    finally:
        sys.modules.pop(name, None)
