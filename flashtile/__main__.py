"""``python -m flashtile`` runs the ``flashtile`` command (see :mod:`flashtile.cli`)."""

import sys

from flashtile.cli import main

sys.exit(main())
