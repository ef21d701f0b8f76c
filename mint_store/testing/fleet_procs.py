"""The processes of the fleet kill-safety check: moto's S3 server and ``mint serve`` subprocesses.

Each server is one ``mint serve`` (writer, ``--standby`` or ``--replica``) with its own index
directory, as on its own machine; its stderr goes to a log file (a full pipe would stall it).
Helpers here talk to the servers over plain HTTP (aiohttp): the core never imports the
client package.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

WAIT_S = 120.0  # a bound on waits for another process (a loaded machine is slow), never a verdict
TENANT = "crash"


class Moto:
    """moto's S3 server on 127.0.0.1 in this process, with one fresh bucket."""

    def __init__(self) -> None:
        try:
            import boto3
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise RuntimeError(f"the fleet mode needs moto[server] and boto3 ({e}): "
                               "pip install 'moto[server]'") from None
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = f"mint-fleet-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}/mint"

    def storage_options(self) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def env(self) -> dict[str, str]:
        """The environment of a server on this bucket (and this checkout on its path)."""
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return dict(os.environ, PYTHONPATH=path, AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID="testing",
                    AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")

    def stop(self) -> None:
        self._server.stop()


class Server:
    """One ``mint serve`` slot: relaunched in place (same index dir) after a kill."""

    def __init__(self, name: str, role: str, workdir: Path, moto: Moto, ttl_s: float, renew_s: float) -> None:
        self.name, self.role = name, role  # role: how it was last launched (writer, standby, replica)
        self.index = workdir / f"{name}-index"
        self.log = workdir / f"{name}.log"
        self.log.touch()
        self.moto, self.ttl_s, self.renew_s = moto, ttl_s, renew_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.launches = 0
        self._log_from = 0  # where this launch's log lines start

    def launch(self, role: str) -> None:
        argv = [sys.executable, "-m", "mint_store.cli", "serve", "--store", self.moto.url, "--index", str(self.index),
                "--port", "0", "--lease-ttl", str(self.ttl_s), "--lease-renew", str(self.renew_s)]
        argv += {"writer": [], "standby": ["--standby"], "replica": ["--replica"]}[role]
        self.role, self.url = role, None
        self._log_from = self.log.stat().st_size
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         env=self.moto.env())
        self.launches += 1

    async def ready(self) -> str:
        """This launch's URL once it serves (raises RuntimeError if it exits or never serves)."""
        stop = time.monotonic() + WAIT_S
        while self.url is None:
            if self.exited() is not None:
                raise RuntimeError(f"{self.name} ({self.role}) exited with {self.exited()}: {self.log_tail()}")
            if time.monotonic() > stop:
                raise RuntimeError(f"{self.name} ({self.role}) did not start serving: {self.log_tail()}")
            with open(self.log, "rb") as f:
                f.seek(self._log_from)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith("mint: serving ") and " on http" in line:
                        self.url = line.rsplit(" on ", 1)[-1].strip()
                        break
            await asyncio.sleep(0.05)
        return self.url

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (a reaped pid is what tells a standby on this host the holder is gone)."""
        if self.proc is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait(WAIT_S)

    def terminate(self) -> None:
        """SIGTERM (a graceful stop releases the lease); SIGKILL if it does not stop in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 8) -> str:
        return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def health(http: aiohttp.ClientSession, url: str | None, timeout: float = 3.0) -> dict[str, Any] | None:
    """``/healthz`` of ``url`` (a 503 body too), or None when it does not answer in time."""
    if url is None:
        return None
    try:
        async with http.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await r.json(content_type=None)
            return dict(body) if isinstance(body, dict) else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def is_writer(h: dict[str, Any] | None) -> bool:
    return h is not None and h.get("status") == "ok" and h.get("writable") is True


async def publish(http: aiohttp.ClientSession, url: str, name: str, files: tuple[bytes, bytes], base: str,
                  timeout: float) -> tuple[int, dict[str, Any]]:
    """PUT one adapter (its two PEFT files); (HTTP status, JSON body)."""
    form = aiohttp.FormData()
    for field, data in zip(("adapter_config.json", "adapter_model.safetensors"), files, strict=True):
        form.add_field(field, data, filename=field, content_type="application/octet-stream")
    async with http.put(f"{url}/v1/adapters/{TENANT}/{name}", data=form, params={"base": base},
                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        try:
            body = json.loads(await r.read())
        except ValueError:
            body = {}
        return r.status, body if isinstance(body, dict) else {}


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=WAIT_S)) as r:
        return r.status, await r.json(content_type=None)


async def get_content(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes, dict[str, str]]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=WAIT_S)) as r:
        return r.status, await r.read(), dict(r.headers)
