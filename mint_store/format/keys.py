"""The grammar of the storage keys the writer produces, and the checks readers apply to keys read back.

The writer forms every shard key here (:func:`shard_key`, used by :mod:`mint_store.format.packs`)::

    packs/<layout id>/rows/c/<shard>/0     layout id: 32 lowercase hex digits (sha256 prefix,
                                           mint_store.format.layout); shard: a decimal number, no
                                           leading zero (Zarr v3's default chunk key of a
                                           (rows, 1-column-shard) array)

A key that comes back from storage -- in a log event, a checkpoint, an index record -- is
data anyone who can write to the store could have planted: ``/path/of/tokens.json`` or
``packs/../../x`` would otherwise reach a read (served to a tenant as an adapter's bytes) or
a delete (a sweep removing a file outside the store). So every such key is checked against
this one grammar (:func:`check_shard_key`) before it reaches an index, a path, a read or a
delete; a key that fails is :class:`~mint_store.errors.InvalidKey`, i.e. corrupt storage.

:func:`check_relative_key` is the storage backends' own, looser, second line of defence:
any key at all must stay below the backend's root (local directory or S3 prefix).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..errors import InvalidKey

PACKS_PREFIX = "packs/"
_HEX32 = "[0-9a-f]{32}"
_SHARD_RE = re.compile(rf"packs/({_HEX32})/rows/c/(0|[1-9][0-9]{{0,17}})/0")
_LAYOUT_RE = re.compile(_HEX32)
_BAD_CHAR = re.compile(r"[\x00-\x1f\x7f\\]")
_BAD_SEGMENT = re.compile(r"(?:^|/)\.{0,2}(?:/|$)")  # "", "." or ".." between slashes (or at an end)


def pack_prefix(layout_id: str) -> str:
    """``packs/<layout_id>``: the Zarr group of one layout's array."""
    return f"packs/{layout_id}"


def shard_key(layout_id: str, shard: int) -> str:
    """The key of shard ``shard`` of layout ``layout_id``'s array (the only shard keys written)."""
    return f"packs/{layout_id}/rows/c/{shard}/0"


def check_layout_id(layout_id: Any, *, where: str = "") -> str:
    """``layout_id`` if it is a layout id (32 lowercase hex digits); InvalidKey otherwise."""
    if not (isinstance(layout_id, str) and _LAYOUT_RE.fullmatch(layout_id)):
        raise InvalidKey(f"{where or 'storage'} names layout id {_shown(layout_id)}, not 32 lowercase hex "
                         "digits as the writer forms them: corrupt or planted; not used")
    return layout_id


def check_shard_key(key: Any, layout_id: str | None = None, *, where: str = "") -> str:
    """``key`` if it is a shard key the writer could have written (of ``layout_id``'s pack, when given).

    Raises
    ------
    InvalidKey
        ``key`` is not ``packs/<layout id>/rows/c/<n>/0`` (an absolute path, a ``..``, another
        prefix, a non-string), or it lies in another layout's pack than ``layout_id``.
    """
    m = _SHARD_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        raise InvalidKey(f"{where or 'storage'} names shard key {_shown(key)}, which is not of the form "
                         "packs/<layout id>/rows/c/<n>/0 the writer produces: corrupt or planted; not used")
    if layout_id is not None and m.group(1) != layout_id:
        raise InvalidKey(f"{where or 'storage'} names shard {key} for layout {layout_id}: that shard lies "
                         "in another layout's pack; not used")
    return key


def check_shard_keys(keys: Any, layout_id: str | None = None, *, where: str = "") -> None:
    """:func:`check_shard_key` of every key of the list ``keys`` (a non-list is InvalidKey too)."""
    if not isinstance(keys, list):
        raise InvalidKey(f"{where or 'storage'} holds {_shown(keys)} where a list of shard keys belongs")
    for k in keys:
        check_shard_key(k, layout_id, where=where)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_event_keys(event: dict[str, Any]) -> None:
    """Every key, layout id and position a log event names, checked before it is applied.

    Publish: each row group's layout id and shard keys (in that layout's pack) and the rows'
    row numbers and offsets; compact: the layout id, each move's shard (in its pack) and
    position, the retired shards (in its pack); sweep: the swept shards. Other kinds name no key.

    Raises
    ------
    InvalidKey
        The event names a key the writer never produces: the event is corrupt (or planted),
        and nothing of it may be applied.
    """
    kind = event.get("kind")
    where = f"log event {event.get('seq')!r} ({kind})"
    try:
        if kind == "publish":
            for group in event["rows"]:
                layout_id = check_layout_id(group["layout_id"], where=where)
                if not _count(group["length"]):
                    raise InvalidKey(f"{where} gives row length {_shown(group['length'])}")
                for sh in group["shards"]:
                    check_shard_key(sh["key"], layout_id, where=where)
                    for _cid, row, offset in sh["rows"]:
                        if not (_count(row) and _count(offset)):
                            raise InvalidKey(f"{where} places a row at {_shown(row)}/{_shown(offset)}")
        elif kind == "compact":
            layout_id = check_layout_id(event["layout_id"], where=where)
            for _cid, row, key, offset in event["moves"]:
                check_shard_key(key, layout_id, where=where)
                if not (_count(row) and _count(offset)):
                    raise InvalidKey(f"{where} moves a row to {_shown(row)}/{_shown(offset)}")
            check_shard_keys(event["retired"], layout_id, where=where)
        elif kind == "sweep":
            check_shard_keys(event["shards"], where=where)
    except (KeyError, TypeError, ValueError) as e:  # a missing field or wrong shape: as corrupt
        if isinstance(e, InvalidKey):
            raise
        raise InvalidKey(f"{where} does not have the shape the writer writes ({e!r}): corrupt or planted; "
                         "not applied") from None


def bad_index_keys(shards: Iterable[tuple[bytes, dict[str, Any]]],
                   blobs: Iterable[tuple[bytes, dict[str, Any]]]) -> list[str]:
    """Problems of the shard keys index records name (a loaded checkpoint's ``shards`` and
    ``blobs`` databases); empty when every key is one the writer produces."""
    out: list[str] = []
    for k, rec in shards:
        try:
            check_shard_key(k.decode("utf-8", "replace"), rec.get("layout_id") if isinstance(rec, dict) else None,
                            where="index record shards")
        except InvalidKey as e:
            out.append(str(e))
    for k, rec in blobs:
        try:
            if not isinstance(rec, dict):
                raise InvalidKey(f"index record blobs/{k[:64]!r} is not a record")
            where = f"index record blobs/{k.decode('utf-8', 'replace')[:64]}"
            check_shard_key(rec.get("shard"), rec.get("layout_id"), where=where)
        except InvalidKey as e:
            out.append(str(e))
    return out


# -- any key, at the storage backends -------------------------------------------------------


def check_relative_key(key: Any, *, prefix: bool = False) -> str:
    """``key`` if it stays below a storage root: relative, ``/``-separated, no empty, ``.`` or
    ``..`` segment, no backslash, NUL or other control character. With ``prefix`` (a listing),
    the empty key (everything) and one trailing ``/`` are allowed too.

    Raises
    ------
    InvalidKey
        ``key`` would name something outside the root (or something else than it says).
    """
    if not isinstance(key, str):
        raise InvalidKey(f"storage key {_shown(key)} is not a string")
    body = key[:-1] if prefix and key.endswith("/") else key
    if prefix and body == "":
        return key
    problem = None
    if body == "":
        problem = "is empty"
    elif body.startswith("/"):
        problem = "is an absolute path"
    elif _BAD_CHAR.search(body):
        problem = "holds a backslash or a control character (NUL, newline, ...)"
    elif _BAD_SEGMENT.search(body):
        problem = "has an empty, '.' or '..' segment"
    if problem is not None:
        raise InvalidKey(f"storage key {_shown(key)} {problem}: it could name an object outside the store's "
                         "root, so it is refused")
    return key


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:120] + "..."
