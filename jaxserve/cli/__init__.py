"""The ``jaxserve`` command: argument parsing, ``serve``, ``run-batch``, ``convert`` and
multihost serving; ``bench``, ``sweep``, ``eval`` and ``plan-autoscaling`` dispatch to the
packages beside it (``jaxserve.bench``, ``jaxserve.eval``, ``jaxserve.autoscaling``)."""
