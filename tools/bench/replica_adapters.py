"""Small shared pieces of the replica benchmarks: a moto bucket and a tiny adapter."""

from __future__ import annotations

import os
import uuid
from typing import Any

for _k, _v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
               ("AWS_DEFAULT_REGION", "us-east-1")):
    os.environ.setdefault(_k, _v)


def moto_bucket() -> tuple[Any, str, str]:
    """A ThreadedMotoServer on 127.0.0.1 with a fresh bucket: (server, endpoint, store URL)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return server, endpoint, f"s3://{bucket}/mint"


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def tiny_adapter(seed: int) -> Any:
    """A rank-1 adapter on two modules (a row of a few hundred bytes), seeded."""
    import torch

    from mint_store.format.adapter import make_adapter

    g = torch.Generator().manual_seed(seed)
    mods = {f"model.layers.0.self_attn.{m}": (torch.randn(1, 16, generator=g), torch.randn(16, 1, generator=g), 1.0)
            for m in ("q_proj", "v_proj")}
    return make_adapter(mods, base="bench")
