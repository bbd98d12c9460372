"""Per-step records for the planners that size fleets: NVIDIA Dynamo's ForwardPassMetrics v1.

``forward_pass`` turns one completed step's plan and the waiting queue into the record's
numbers (as Dynamo's vLLM scheduler does); ``publisher`` sends them on a ZMQ PUB socket from its
own thread, so the step only pays for the counting and one ``put_nowait``. Started by the
engine with ``--forward-pass-metrics-port`` (docs/fleet-metrics.md). Imports no jax; pyzmq is
imported only when a publisher starts.
"""
