"""``jaxserve bench``: load generation and measurement for OpenAI-compatible servers.

Modules:
  datasets  -- synthetic workloads (``random``, ``prefix``) as ``SampleRequest`` lists.
  arrivals  -- request arrival times: closed burst, Poisson, or gamma (burstiness) open loop.
  client    -- one streamed request over httpx, timed per chunk (TTFT, ITL, latency).
  metrics   -- vLLM ``benchmark_serving`` metrics from per-request timelines; the result table.
  serve     -- ``jaxserve bench serve``: flags (vLLM's names), the run, the saved JSON.

Only ``serve`` (issue 6 item 1) exists so far; ``bench throughput`` and ``sweep`` come later.
"""
