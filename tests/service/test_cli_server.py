"""``mint ... --server URL`` goes through a running service with the same results."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from mint_store.cli.commands import main
from tests.support.service import TOKENS


async def mint(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))  # the server runs on this loop: don't block it
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_cli_through_the_server(make_server, local_target, tokens_file, peft_dir: Path, tmp_path: Path,
                                      capsys, monkeypatch) -> None:
    from tests.support.hf_models import load_peft, logits

    server = await make_server(local_target, tokens_file=tokens_file)
    monkeypatch.setenv("MINT_SERVER", server.url)
    monkeypatch.setenv("MINT_TOKEN", TOKENS["acme"])
    code, out, err = await mint(capsys, "publish", str(peft_dir), "--name", "acme/chat", "--tag", "prod", "--json")
    assert code == 0, err
    pub = json.loads(out)
    assert (pub["version"], pub["deduplicated"]) == (1, False)
    code, out, _ = await mint(capsys, "show", "acme/chat:prod", "--json")
    assert json.loads(out)["content_id"] == pub["content_id"]
    code, out, _ = await mint(capsys, "ls", "acme", "--json")
    assert json.loads(out) == [{"tenant": "acme", "name": "chat", "latest": 1, "versions": 1}]
    code, _, _ = await mint(capsys, "pull", "acme/chat:prod", "-o", str(tmp_path / "out"))
    assert code == 0
    assert torch.equal(logits(load_peft(peft_dir)), logits(load_peft(tmp_path / "out")))
    code, out, _ = await mint(capsys, "tag", "acme/chat@1", "canary", "--json")
    assert json.loads(out)["version"] == 1
    code, out, err = await mint(capsys, "show", "beta/x", "--json")  # another tenant's: refused
    assert code == 1 and out == "" and "mint: error:" in err
    code, out, _ = await mint(capsys, "rm", "acme/chat@1", "--json")
    assert json.loads(out)["deleted"] is True
    code, out, err = await mint(capsys, "show", "acme/chat", "--token", "wrong")
    assert code == 1 and "token" in err.lower()
