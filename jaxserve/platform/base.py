"""What every platform answers: the questions the engine asks about the machine it runs on.

The engine never learns why: it asks ``platform.resolve_dtype``, ``attention``,
``prepare_weights``, ``buckets``, ``step_overhead_tokens`` and ``step_cost_prior`` and uses the
answers. The CPU's
answers are in ``jaxserve.platform.cpu``, the accelerators' in ``jaxserve.platform.gpu``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from cpu_kernels.attention import native_attention_fn
from jaxserve.config import EngineConfig
from models.config import ModelConfig
from models.quant import QuantTargets
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_mosaic,
    ragged_paged_attention_pallas,
)


@dataclass(frozen=True)
class BucketSet:
    """Which step shapes beyond the powers of two a platform compiles
    (``jaxserve.device.buckets.token_buckets``).

    Fields:
      small: token buckets below 8, ascending (each costs a model and a sampler program).
      mid_up_to: compile the buckets ``3 * 2**k`` from 24 up to this many tokens (0: none).
      sampler_rows: the row counts that get a sampler program; a bucket of ``S`` rows samples
        with the smallest at least ``S``, its logits padded with zero rows (empty: one sampler
        per row count; ``jaxserve.device.step_buffer.sampler_rows_for``).
      defer_compile: a server may become ready once ``device.buckets.ready_buckets`` are
        compiled and compile the others after (``EngineConfig.background_compile``); False:
        every program compiles before ready.
      min_tokens: no token bucket below this many tokens (but the largest): batch invariance
        needs every step's matmuls in one row class (``Platform.batch_invariant``).
    """

    small: tuple[int, ...] = ()
    mid_up_to: int = 0
    sampler_rows: tuple[int, ...] = ()
    defer_compile: bool = False
    min_tokens: int = 1


@dataclass(frozen=True)
class StepCostPrior:
    """A platform's step-cost model before any step is measured (the arguments of
    ``core.step_cost.StepCostModel.prior``): a step's fixed cost in prompt tokens, seconds a
    prompt token, seconds a prompt query-key pair."""

    step_overhead_tokens: int
    prompt_token_s: float
    prefill_pair_s: float


def attention_fn(backend: str, invariant: bool = False) -> Callable[..., jax.Array]:
    """The attention op (signature: ``pallas_kernels.ragged_paged_attention``) of a resolved
    backend: "reference" the pure-jnp op; "native" the jnp op with its decode and prefill rows in
    the native CPU kernel; "pallas" the Pallas Triton kernel; "pallas-interpret" that kernel in
    the Pallas interpreter (CPU tests; minutes for a few tokens); "mosaic" the Pallas Mosaic GPU
    kernel (Hopper and newer); "mosaic-interpret" that kernel in GPU interpret mode (CPU tests,
    race detector on; minutes for a few tokens). ``invariant``: every row in
    one reduction order, whatever its step (``Platform.batch_invariant``; "native" only).

    Raises:
      ValueError: an unresolved ("auto") or unknown backend; ``invariant`` with a backend
        other than "native".
    """
    if invariant and backend != "native":
        raise ValueError(f"batch-invariant attention runs in the native CPU kernel only, not "
                         f"with attention_backend={backend!r}")
    if backend == "reference":
        return ragged_paged_attention
    if backend == "native":
        return native_attention_fn(prefill=True, invariant=invariant)
    if backend == "pallas":
        return ragged_paged_attention_pallas
    if backend == "pallas-interpret":
        return functools.partial(ragged_paged_attention_pallas, interpret=True)
    if backend == "mosaic":
        return ragged_paged_attention_mosaic
    if backend == "mosaic-interpret":
        return functools.partial(ragged_paged_attention_mosaic, interpret=True)
    raise ValueError(f"attention backend {backend!r} is not a resolved backend")


class Platform(ABC):
    """One backend's policy. ``name`` is jax's platform name ("cpu", "gpu", ...)."""

    name: str
    step_overhead_tokens: int
    """A step's fixed cost in prompt tokens of compute (``SchedulerConfig.step_overhead_tokens``,
    which weighs padding a step against running another)."""
    prompt_token_s: float | None = None
    """Seconds one prompt token of a step costs, the prior of the engine's step-cost model
    (``core.step_cost.StepCostModel.prior``) where it does not depend on the model
    (``step_cost_prior``); None: no such constant."""
    prefill_pair_s: float = 0.0
    """Seconds one query-key pair of a prompt chunk's attention costs, the prior of the
    step-cost model's pair term (a long prompt's late chunks cost more than its first)."""
    default_slos_ms: tuple[float, float] | None = None
    """The service objectives (first token, largest gap; ms) when ``--ttft-slo-ms`` /
    ``--itl-slo-ms`` are not given (``config.DEFAULT_SLOS_MS``); None: none by default."""

    def step_cost_prior(self, model_config: ModelConfig, dtype: jnp.dtype
                        ) -> StepCostPrior | None:
        """The step-cost model's prior for this model with weights stored in ``dtype``; None
        where the platform has none (``--itl-slo-ms`` is then refused). Default: the class
        constants ``step_overhead_tokens``, ``prompt_token_s``, ``prefill_pair_s``."""
        if self.prompt_token_s is None:
            return None
        return StepCostPrior(self.step_overhead_tokens, self.prompt_token_s, self.prefill_pair_s)

    @abstractmethod
    def resolve_dtype(self, name: str) -> jnp.dtype:
        """The weights' dtype for a ``--dtype`` value ("auto" resolved; others as they are)."""

    @abstractmethod
    def compute_dtype(self, dtype: jnp.dtype) -> jnp.dtype:
        """The activations' dtype for weights stored in ``dtype``."""

    @abstractmethod
    def attention_backend(self, config: EngineConfig) -> str:
        """``config.attention_backend`` with "auto" resolved, checked against this platform and
        ``config.cpu_kernels``.

        Raises:
          ValueError: a backend or a ``cpu_kernels`` setting this platform cannot run (the
            message names the field).
          RuntimeError: ``cpu_kernels="on"`` where the native CPU kernels cannot be loaded.
        """

    @abstractmethod
    def prepare_weights(self, params, config: EngineConfig, dtype: jnp.dtype,
                        targets: QuantTargets | None):
        """``params`` made ready for this platform's kernels (e.g. packed for a native matmul);
        ``targets``: the architecture's quantisable leaves (None: it has none)."""

    @abstractmethod
    def buckets(self, config: EngineConfig) -> BucketSet:
        """The step shapes worth compiling beyond the powers of two."""

    def batch_invariant(self, config: EngineConfig) -> bool:
        """``config.batch_invariant`` resolved: whether every sequence's logits are bit-identical
        whatever else its steps hold (docs/configuration.md#batch-invariance). Where no platform
        overrides this, only "off" and "auto" (off) are accepted.

        Raises:
          ValueError: "on" where this platform cannot run it (the message names the field).
        """
        if config.batch_invariant == "on":
            raise ValueError(f"batch_invariant='on' is built for the CPU only, not for "
                             f"{self.name!r} yet; use 'auto' or 'off'")
        return False

    def check(self, config: EngineConfig) -> None:
        """Refuse settings this platform cannot run, before any weight is read (the errors of
        ``attention_backend`` and ``batch_invariant``)."""
        self.attention_backend(config)
        self.batch_invariant(config)
