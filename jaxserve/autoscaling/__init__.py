"""``jaxserve plan-autoscaling``: autoscaling thresholds from measurements, and the simulation
that checks them. Pure Python and numpy (no jax); the plot (``--sim-plot``) needs matplotlib,
the ``autoscaling`` extra (``pip install 'jaxserve[autoscaling]'``).

Modules:
  curve     one replica's throughput and tail latencies against concurrency, from a sweep.
  plan      the arithmetic: SLO-limited capacity, early trigger, threshold, the snippet.
  command   the command: flags, reading the inputs, printing and writing the plan.
  hpa       the Kubernetes HPA's decision: tolerance, stabilisation windows, scale policies.
  simulate  bursty ramp traces; replicas behind a router under the HPA, event by event.
  report    the planned threshold against a naive one on a ramp: the table and the plot.
"""
