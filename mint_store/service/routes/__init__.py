"""The HTTP handlers of ``/v1``: adapters, uploads, PEFT export, blobs and blocks, the catalog,
and the store-wide routes (resolve, layouts, bases, events, admin); request parsing helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .export import PeftExport, build_export
    from .parsing import float_param, int_param, route_label
    from .uploads import Upload, UploadLimits

_EXPORTS = {
    "PeftExport": ".export",
    "Upload": ".uploads",
    "UploadLimits": ".uploads",
    "build_export": ".export",
    "float_param": ".parsing",
    "int_param": ".parsing",
    "route_label": ".parsing",
}

__all__ = [
    "PeftExport",
    "Upload",
    "UploadLimits",
    "build_export",
    "float_param",
    "int_param",
    "route_label",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
