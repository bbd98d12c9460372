"""``jaxserve eval``: quality and memory of quantised configurations against the unquantised
model, on a corpus and a prompt set.

Modules:
  inputs   the ``--compare`` configurations, the corpus and the prompt set, read and checked
           before any model loads; the default set shipped in ``jaxserve/data/``.
  quality  the command: flags, the baseline and compared engines, the scores, the table.
"""
