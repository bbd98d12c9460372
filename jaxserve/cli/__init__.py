"""The ``jaxserve`` command: argument parsing and the subcommands (serve, run-batch, convert,
eval, bench, sweep)."""
