"""``python -m mint_store.cli``: the ``mint`` command (the processes tests and fleets start use it)."""

import sys

from .commands import main

sys.exit(main())
