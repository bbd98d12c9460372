"""``jaxserve eval``: quality and memory of quantised configurations against the unquantised
model, on a corpus and a prompt set.

Modules:
  inputs   the ``--compare`` configurations, the corpus and the prompt set, read and checked
           before any model loads; the default set shipped in ``jaxserve/data/``.
  scoring  a corpus scored in overlapping windows, greedy continuations, an engine's memory.
  quality  the command: flags, the baseline and compared engines, the metrics, the table.
"""
