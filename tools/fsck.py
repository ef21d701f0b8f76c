#!/usr/bin/env python3
"""`mint fsck` as a program for admins who script it: same options, same output, same exit code.

    python tools/fsck.py --store ./mint-data --json
"""

from __future__ import annotations

import sys

from mint_store.cli.commands import main

if __name__ == "__main__":
    sys.exit(main(["fsck", *sys.argv[1:]]))
