"""The client raises the store's own typed errors, plus a few that only a network has.

An HTTP error response ``{"error": code, "message": ...}`` becomes the class with that
``code`` (``adapter_not_found`` -> :class:`AdapterNotFound`, and so on), so code written
against a local store handles a remote one unchanged.
"""

from __future__ import annotations

from mint_store.errors import (
    AdapterNotFound,
    BaseMismatch,
    BaseNotFound,
    BlobNotFound,
    Conflict,
    DamagedAdapter,
    IntegrityError,
    InvalidAdapter,
    InvalidName,
    LayoutNotFound,
    LimitExceeded,
    MintError,
    NotFound,
    NotTheWriter,
    ReadOnlyStore,
    StaleLocation,
    StoreClosed,
    TagNotFound,
    UnsupportedAdapter,
    VersionDeleted,
    VersionNotFound,
    WriterFenced,
    WriterLocked,
)
from mint_store.format.wire import (
    TERMINAL_CODES,
    BadRequest,
    BodyTooLarge,
    ConnectionFailed,
    Forbidden,
    HTTPError,
    MethodNotAllowed,
    NotImplementedYet,
    RangeNotSatisfiable,
    RequestTimeout,
    RouteNotFound,
    ServiceUnavailable,
    Unauthorized,
    UnsupportedMediaType,
    error_from_body,
)

__all__ = [
    "TERMINAL_CODES",
    "AdapterNotFound",
    "BadRequest",
    "BaseMismatch",
    "BaseNotFound",
    "BatchMismatch",
    "BlobNotFound",
    "BodyTooLarge",
    "Conflict",
    "ConnectionFailed",
    "DamagedAdapter",
    "DeviceBudgetExceeded",
    "EngineClosed",
    "EngineError",
    "Forbidden",
    "HTTPError",
    "HostPoolTooSmall",
    "IntegrityError",
    "InvalidAdapter",
    "InvalidName",
    "LayoutMismatch",
    "LayoutNotFound",
    "LimitExceeded",
    "MethodNotAllowed",
    "MintError",
    "NoVersionToRollBack",
    "NotFound",
    "NotImplementedYet",
    "NotTheWriter",
    "OutOfSlots",
    "PolicyExists",
    "PolicyNotFound",
    "RangeNotSatisfiable",
    "ReadOnlyStore",
    "RequestTimeout",
    "RouteNotFound",
    "ServiceUnavailable",
    "StaleLocation",
    "StoreClosed",
    "TPBatchFailed",
    "TagNotFound",
    "TrainerError",
    "Unauthorized",
    "UnsupportedAdapter",
    "UnsupportedMediaType",
    "VersionDeleted",
    "VersionNotFound",
    "WriterFenced",
    "WriterLocked",
    "error_from_body",
]


# ---------------------------------------------------------------- engine-side errors


class EngineError(MintError):
    """Base of the errors the engine side (pools, streamer, LoRAEngine) raises itself."""

    code = "engine_error"


class LayoutMismatch(BaseMismatch):
    """An adapter's layout does not fit the model it would run on (names the first mismatch)."""

    code = "layout_mismatch"


class OutOfSlots(EngineError, RuntimeError):
    """A batch needs more distinct adapters of one layout than the device pool has free slots."""

    code = "out_of_slots"


class DeviceBudgetExceeded(EngineError, RuntimeError):
    """A new layout's device pool does not fit in the engine's ``device_bytes``, even after
    dropping every pool that no batch, pin or prefetch is using."""

    code = "device_budget_exceeded"


class HostPoolTooSmall(EngineError, ValueError):
    """A row larger than the whole pinned host pool: it can never be staged."""

    code = "host_pool_too_small"


class BatchMismatch(EngineError, ValueError):
    """The adapter list does not match the batch (length, or token counts per sequence)."""

    code = "batch_mismatch"


class EngineClosed(EngineError, RuntimeError):
    code = "engine_closed"


class TPBatchFailed(EngineError, RuntimeError):
    """On a tensor-parallel engine, a batch failed to load on one or more ranks; every rank
    raises this one error (naming each failed rank and why) at the same batch boundary."""

    code = "tp_batch_failed"


# ---------------------------------------------------------- training (train/trainer.py, train/grpo.py)


class TrainerError(EngineError):
    """Base of the errors the multi-policy trainer raises itself."""

    code = "trainer_error"


class PolicyNotFound(TrainerError, KeyError):
    """A policy name the trainer does not hold."""

    code = "policy_not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PolicyExists(TrainerError, ValueError):
    """``add_policy`` with a name the trainer already holds."""

    code = "policy_exists"


class NoVersionToRollBack(TrainerError, RuntimeError):
    """``rollback`` with no earlier published version to move the tag to."""

    code = "no_version_to_roll_back"
