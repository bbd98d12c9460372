"""``jaxserve bench`` and ``jaxserve sweep``: load generation, measurement and tuning.

``bench serve`` and ``sweep`` need httpx, and the sweep's plots matplotlib: the ``bench`` extra
(``pip install 'jaxserve[bench]'``), asked for when they run (``jaxserve.extras``).

Modules:
  datasets      workloads (``random``, ``sharegpt-like``, ``prefix``, ``trace``) as
                ``SampleRequest`` lists; the shipped public-domain text (``jaxserve/data/``).
  profiles      production-shaped workloads (``chat-like``, ``code-like``,
                ``mixed-system-prompt``): trace-fitted lengths and default burstiness.
  arrivals      request arrival times: closed burst, Poisson, or gamma (burstiness) open loop.
  client        one streamed request over httpx, timed per chunk (TTFT, ITL, latency).
  metrics       vLLM ``benchmark_serving`` metrics from per-request timelines; the result table.
  serve         ``jaxserve bench serve``: flags (vLLM's names), the run, the saved JSON.
  static_batch  the static-batching baseline on an engine's own runner.
  throughput    ``jaxserve bench throughput``: offline, continuous against static batching.
  step          ``jaxserve bench step``: one engine step per batch size and sampling mode.
  prefix_cache  ``jaxserve bench prefix-cache``: a shared system prompt, caching off and on.
  startup       ``jaxserve bench startup``: launch to /ready 200, cold and warm.
  common        the in-process commands' model flags, percentiles and JSON file.
  sweep         ``jaxserve sweep``: concurrency (and engine-setting) sweep, knee, SLO limit,
                the table.
  sweep_report  the sweep's recommended ``--config`` files and plots.
"""
