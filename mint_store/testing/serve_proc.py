"""One ``mint serve`` subprocess driven synchronously: started, its URL read off its log, polled, stopped.

Shared by the standby failover tests and the failover benchmark (the fleet check's asyncio
servers are in :mod:`.fleet_procs`). stderr goes to a file next to the index: a full pipe
would stall the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

WAIT_S = 180.0  # a bound on waits for another process (a loaded machine is slow), never a verdict


def wait_until(probe: Callable[[], Any], what: str) -> Any:
    """``probe()``'s first value that is not None or False; TimeoutError after :data:`WAIT_S`."""
    stop = time.monotonic() + WAIT_S
    while (got := probe()) in (None, False):
        if time.monotonic() > stop:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


class ServeProcess:
    """``mint serve --store store_url --index index`` (``--standby`` if asked) with a lease TTL and renew."""

    def __init__(self, store_url: str, index: Path, env: dict[str, str], ttl_s: float, renew_s: float, *,
                 standby: bool = False) -> None:
        self.log = index.with_suffix(".log")
        argv = [sys.executable, "-m", "mint_store.cli", "serve", "--store", store_url, "--index", str(index),
                "--port", "0", "--lease-ttl", str(ttl_s), "--lease-renew", str(renew_s)]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(argv + (["--standby"] if standby else []), stderr=err, env=env)
        self.url: str = wait_until(self._served_url, "mint serve to start")

    def _served_url(self) -> str | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"mint serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        for line in self.log.read_text().splitlines():
            if " serving " in line:
                return line.split(" on ")[-1].strip()
        return None

    def health(self) -> dict[str, Any]:
        """``/healthz`` (a 503's body too)."""
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=WAIT_S) as r:
                return dict(json.load(r))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read()))

    def stop(self) -> None:
        """SIGCONT (it may be stopped), SIGKILL, reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(WAIT_S)
