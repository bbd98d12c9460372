#!/bin/bash
# interleaved start-up A/B: base (9a13e20, start of session) vs main; each run from its own tree
for r in 1 2; do
  for v in base main; do
    if [ $v = base ]; then PP=/work/wt/base; else PP=/work/main; fi
    cd $PP
    echo "== $v round $r $(uptime)"
    PYTHONPATH=$PP /work/main/.venv/bin/python -m jaxserve.cli.main bench startup --model '' --load-format auto --repeats 1 --output-json /tmp/s17/ab_${v}_$r.json 2>&1 | tail -4
  done
done
