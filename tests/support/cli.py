"""Run the ``mint`` CLI in-process, as the CLI tests do."""

from __future__ import annotations

import pytest

from mint_store.cli.commands import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``mint *argv`` in this process: (exit code, stdout, stderr) captured by ``capsys``."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
