"""``python -m idemproxy.proxy.cli``: the ``idemproxy`` command without its script."""

import sys

from . import main

sys.exit(main())
