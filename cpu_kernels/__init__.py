"""Native C++ kernels for XLA:CPU, as XLA FFI custom calls, beside the jnp paths they replace.

- ``attention``: ragged paged attention's decode rows, and its prefill rows
  (``native_attention_fn``: ``pallas_kernels``' jnp op with those rows in the kernel);
- ``bf16_matmul``: activation rows times one layer of a stacked bfloat16 weight, packed for
  AVX512-BF16 (``pack``);
- ``int4_matmul``: a few activation rows times an int4 weight (``models.quant_formats``);
- ``build``: the shared library, built ahead of serving per ISA variant (``jaxserve
  build-kernels``) and loaded for the best variant this CPU runs.

Without a built library every kernel's ``available()`` is False and callers keep the jnp paths.
This package may import ``pallas_kernels`` (the jnp op, the KV-cache layout), never the reverse.
"""
