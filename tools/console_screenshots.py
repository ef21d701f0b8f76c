#!/usr/bin/env python3
"""Screenshots of the web console (docs/console/*.png); not a test.

    python tools/console_screenshots.py [--out docs/console]

Builds a small sample store (random adapters of a few tenants, tags, deduplicated and deleted
versions, shards of mixed live ratios), serves it on loopback with a token file, and drives
Debian's chromium through chromium-driver with the browser tests' setup
(tests/support/browser.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import _repo  # noqa: F401  (puts the repository root on sys.path: tests.support imports)
import torch

from mint_store.format.adapter import make_adapter
from mint_store.peft.directory import synthesize_config
from mint_store.service import ServerThread, ServiceConfig
from mint_store.store import Store
from tests.support.browser import missing, sign_in, start_chromium, view
from tools._repo import ROOT

ADMIN = "console-admin-token-0001"
HIDDEN, LAYERS = 512, 4


def sample_adapter(seed: int, rank: int, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Any:
    g = torch.Generator().manual_seed(seed)
    mods = {f"model.layers.{i}.self_attn.{m}": (torch.randn(rank, HIDDEN, generator=g) * 0.02,
                                                torch.randn(HIDDEN, rank, generator=g) * 0.02, 2.0)
            for i in range(LAYERS) for m in modules}
    adapter = make_adapter(mods, base="qwen3-4b")
    config = synthesize_config(adapter) | {"base_model_name_or_path": "Qwen/Qwen3-4B", "task_type": "CAUSAL_LM"}
    return make_adapter(mods, base="qwen3-4b", peft_config=config)


def build_store(path: Path) -> None:
    # a batch of publishes shares a shard per layout; shards of up to 2 MiB, so deletes leave
    # shards of several live ratios for the histogram
    with Store.open(str(path), shard_target_bytes=2 << 20) as store:
        plan = [("acme", "chat", 8, 3), ("acme", "summarize", 8, 2), ("acme", "code-review", 16, 4),
                ("acme", "sql-gen", 4, 1), ("acme", "support-bot", 8, 5), ("acme", "translate-de", 4, 2),
                ("beta", "legal-qa", 8, 2), ("beta", "triage", 16, 1), ("gamma", "search-rerank", 4, 3)]
        seed = 0
        for round_ in range(max(n for *_, n in plan)):
            batch = []
            for tenant, name, rank, versions in plan:
                if round_ < versions:
                    seed += 1
                    batch.append((tenant, name, sample_adapter(seed, rank), "prod" if round_ == versions - 1 else None))
            store.publish_many(batch)
        store.tag("acme/chat@2", "canary")
        store.tag("acme/support-bot@4", "staging")
        store.publish("beta", "chat-copy", sample_adapter(1, 8))  # the same bytes as acme/chat@1: deduplicated
        for ref in ("acme/support-bot@1", "acme/support-bot@2", "acme/code-review@1", "gamma/search-rerank@1",
                    "acme/summarize@1", "acme/code-review@2", "beta/legal-qa@1"):
            store.delete(ref)


def shoot(driver: Any, out: Path, name: str) -> None:
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1440, min(max(900, height + 20), 2400))
    driver.save_screenshot(str(out / f"{name}.png"))
    print(f"wrote {out / name}.png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs" / "console"))
    args = p.parse_args()
    reason = missing()
    if reason:
        print(f"console_screenshots: {reason}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_store(root / "store")
        (root / "tokens.json").write_text(json.dumps({"tokens": [
            {"token": ADMIN, "tenants": [], "role": "admin", "name": "ops"}]}))
        server = ServerThread(ServiceConfig(store=str(root / "store"), host="127.0.0.1", port=0,
                                            tokens_file=str(root / "tokens.json"), auto_compact=False))
        driver = start_chromium(root / "downloads")
        try:
            driver.get(f"{server.url}/ui/")
            shoot(driver, out, "signin")
            sign_in(driver, ADMIN)
            for fragment, page, name in (("#/", "home", "tenants"), ("#/acme", "tenant", "tenant"),
                                         ("#/acme/chat", "adapter", "adapter"), ("#/-/admin", "admin", "admin")):
                driver.set_window_size(1440, 900)
                driver.get(f"{server.url}/ui/{fragment}")
                view(driver, page)
                shoot(driver, out, name)
        finally:
            driver.quit()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
