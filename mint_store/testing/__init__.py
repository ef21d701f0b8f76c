"""Test harnesses for the store's kill-safety checks; not part of the public API (``mint_store.__all__``).

``crash``: a store whose writer stops at a named point of its commit order.
``crashtest``: SIGKILL a writing process at random moments, reopen, verify.
``fleet``: writer + standby + replicas (``mint serve``) on one moto bucket, SIGKILL/SIGSTOP, verify.
"""
