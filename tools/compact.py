#!/usr/bin/env python3
"""`mint compact` as a program for admins who script it: same options, same output, same exit code.

    python tools/compact.py --store ./mint-data --json
"""

from __future__ import annotations

import sys

from mint_store.cli.commands import main

if __name__ == "__main__":
    sys.exit(main(["compact", *sys.argv[1:]]))
