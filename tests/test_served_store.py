"""The README's first steps together: `mint serve` holds a store while the CLI and
``MintClient(path)`` use the same directory beside it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_client import MintClient
from mint_store.cli.commands import main
from mint_store.errors import WriterLocked
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.hf_models import make_peft_dir

DEADLINE_S = 120.0  # a bound for a subprocess to start, never a pass/fail threshold


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A real `mint serve` subprocess on a fresh local store: (store path, server URL)."""
    store = str(tmp_path / "mint-data")
    proc = subprocess.Popen([sys.executable, "-m", "mint_store.cli", "serve", "--store", store, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if "serving" in line:
                url = line.split(" on ")[-1].strip()
                break
        else:
            pytest.fail(f"mint serve exited with {proc.wait(DEADLINE_S)}")
        yield store, url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(DEADLINE_S)
        proc.stderr.close()


def test_the_lease_names_the_server(served: tuple[str, str]) -> None:
    store, url = served
    with pytest.raises(WriterLocked, match=re.escape(url)) as info:
        Store.open(store)
    assert info.value.url == url


def test_cli_writes_go_through_the_server_and_reads_work_beside_it(
    served: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, url = served
    peft = make_peft_dir(tmp_path / "peft", "llama", seed=0, r=4, lora_alpha=8, target_modules=["q_proj"])
    assert main(["publish", str(peft), "--name", "acme/chat", "--tag", "prod", "--store", store]) == 0
    out = capsys.readouterr()
    assert "published acme/chat@1" in out.out
    assert f"--server {url}" in out.err  # and the user learns the command that does this
    assert main(["ls", "acme", "--store", store, "--json"]) == 0
    assert '"name": "chat"' in capsys.readouterr().out
    assert main(["show", "acme/chat:prod", "--store", store]) == 0
    assert "version: 1" in capsys.readouterr().out
    assert main(["pull", "acme/chat:prod", "-o", str(tmp_path / "out"), "--store", store]) == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert main(["tag", "acme/chat@1", "stable", "--store", store]) == 0  # a write: through the server
    assert main(["show", "acme/chat:stable", "--store", store]) == 0
    assert main(["stats", "--store", store, "--json"]) == 0  # reads only: fine beside the server
    capsys.readouterr()
    assert main(["compact", "--store", store]) != 0  # needs the writer: says where to go instead
    assert f"{url}/v1/admin/compact" in capsys.readouterr().err


def test_a_local_client_reads_and_follows_a_served_store(served: tuple[str, str]) -> None:
    store, url = served

    async def scenario() -> None:
        async with MintClient(url) as remote, MintClient(store) as local:
            first = await remote.publish("acme", "a", random_adapter(1))
            loc, _ = await local.read("acme/a")
            assert loc.content_id == first.content_id
            head = (await local.events(0, limit=0)).head
            waiting = asyncio.create_task(local.events(head, wait=DEADLINE_S))
            second = await remote.publish("acme", "b", random_adapter(2), tag="prod")
            batch = await waiting
            assert [i["name"] for e in batch.events for i in e.get("items", [])] == ["b"]
            assert (await local.resolve("acme/b:prod")).content_id == second.content_id
            # writing needs the lease, which the server holds: the error says where to write
            with pytest.raises(WriterLocked, match=re.escape(url)):
                await local.publish("acme", "c", random_adapter(3))
            assert (await local.resolve("acme/b")).content_id == second.content_id  # still reads
        async with MintClient(store, writable=True) as eager:  # asks for the writer at open
            with pytest.raises(WriterLocked, match=re.escape(url)):
                await eager.resolve("acme/a")

    asyncio.run(scenario())


def test_two_clients_in_one_process_share_the_store(tmp_path: Path) -> None:
    path = str(tmp_path / "mint-data")
    with Store.open(path) as s:  # an existing store (as after `mint publish`)
        s.publish("acme", "a", random_adapter(1))

    async def scenario() -> None:
        async with MintClient(path) as one, MintClient(path) as two:
            assert (await one.resolve("acme/a")) == (await two.resolve("acme/a"))
            r1 = await one.publish("acme", "b", random_adapter(2))  # takes the writer lease
            assert (await two.resolve("acme/b")).content_id == r1.content_id
            r2 = await two.publish("acme", "c", random_adapter(3))  # shares that writer
            assert (await one.resolve("acme/c")).content_id == r2.content_id
            with pytest.raises(WriterLocked, match=f"pid {os.getpid()}"):
                Store.open(path, index_dir=str(tmp_path / "elsewhere"))  # still one writer per store
        with Store.open(path) as s:  # both closed: the lease was released
            assert s.last_seq == 3

    asyncio.run(scenario())
