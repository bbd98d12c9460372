"""``python -m jaxserve.cli``: the ``jaxserve`` command."""

import sys

from jaxserve.cli.main import main

sys.exit(main())
