"""One writer process per index, readers beside it, and a store that survives fork."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mint_store.errors import ReadOnlyStore, WriterLocked
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget


def test_second_writer_in_this_process_is_refused(local_target: StoreTarget) -> None:
    with local_target.open(), pytest.raises(WriterLocked, match=r"pid \d+"):
        local_target.open()


def test_second_writer_process_gets_an_error_naming_the_holder(local_target: StoreTarget) -> None:
    code = textwrap.dedent(
        f"""
        from mint_store.store import Store
        from mint_store.errors import WriterLocked
        try:
            Store.open({local_target.url!r}, index_dir={local_target.index_dir!r})
        except WriterLocked as e:
            print("LOCKED", e)
        """
    )
    import os

    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("LOCKED") and f"pid {os.getpid()}" in out.stdout
        # a reader process is fine beside the writer
        reader = textwrap.dedent(
            f"""
            from mint_store.store import Store
            s = Store.open({local_target.url!r}, index_dir={local_target.index_dir!r}, readonly=True)
            print(s.resolve("acme/a").content_id)
            """
        )
        out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == store.resolve("acme/a").content_id


def _child_reads(store, ref: str, q) -> None:
    try:
        _, row = store.read(ref)
        q.put(("ok", row.tobytes()))
        store.publish("acme", "from-child", random_adapter(9))
    except ReadOnlyStore as e:
        q.put(("refused", str(e)))
    except Exception as e:  # reported to the parent, which fails the test
        q.put(("error", repr(e)))


def test_store_is_usable_after_fork(local_target: StoreTarget) -> None:
    ctx = mp.get_context("fork")
    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        q = ctx.Queue()
        p = ctx.Process(target=_child_reads, args=(store, "acme/a", q))
        p.start()
        status, row = q.get(timeout=60)
        refused = q.get(timeout=60)
        p.join(60)
        assert status == "ok"
        np.testing.assert_array_equal(np.frombuffer(row, np.uint8), random_adapter(1).to_row()[1])
        assert refused[0] == "refused"  # the child is not the writer
        # the parent's environment and writer are untouched by the child
        assert store.publish("acme", "b", random_adapter(2)).version == 1
        assert store.resolve("acme/a").content_id == store.resolve("acme/a@1").content_id
