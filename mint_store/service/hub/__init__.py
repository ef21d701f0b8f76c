"""The Hugging Face Hub read protocol under ``/hf`` (``HF_ENDPOINT=http://HOST:8470/hf``):
its routes, and a MinT adapter seen as a Hub model repo (revisions, commit ids, files, card).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .repo import Revision, model_card, model_info
    from .routes import setup_hub

_EXPORTS = {
    "Revision": ".repo",
    "model_card": ".repo",
    "model_info": ".repo",
    "setup_hub": ".routes",
}

__all__ = [
    "Revision",
    "model_card",
    "model_info",
    "setup_hub",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
