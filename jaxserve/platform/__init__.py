"""The platform layer: the only code that asks which backend runs.

``current_platform()`` answers for the backend jax runs on (``jax.default_backend()``): the
weights' and activations' dtypes, the attention op, weight preparation for native kernels, the
step shapes worth compiling and a step's fixed cost (``jaxserve.platform.base.Platform``; the CPU
in ``cpu``, accelerators in ``gpu``). ``configure_process()`` applies the process settings the
entry points want (``jaxserve.platform.process``); importing jaxserve never does.

This package's ``__init__`` imports no jax, so that ``configure_process`` can run before jax
starts; ``current_platform`` imports the platform modules when first called.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from jaxserve.platform.process import configure_process

if TYPE_CHECKING:
    from jaxserve.platform.base import Platform


@functools.cache
def _platform_for(backend: str) -> Platform:
    # local imports (here and below): this package must import without jax (module docstring)
    if backend == "cpu":
        from jaxserve.platform.cpu import CpuPlatform

        return CpuPlatform()
    from jaxserve.platform.gpu import GpuPlatform

    return GpuPlatform(backend)


def current_platform() -> Platform:
    """The ``Platform`` of jax's default backend (one object per backend name).

    Starts jax's backend if it has not started yet: call ``configure_process`` first where the
    process settings are wanted."""
    import jax

    return _platform_for(jax.default_backend())


__all__ = ["configure_process", "current_platform"]
