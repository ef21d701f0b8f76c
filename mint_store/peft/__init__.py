"""The Hugging Face side: PEFT LoRA directories, ``adapter_config.json``, untrusted safetensors,
``hf://`` sources and base models' module shapes from a transformers model or config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .adapter_config import LoraSettings, parse_config
    from .bases import model_shapes, shapes_from_config
    from .directory import load_peft_dir, peft_files, save_peft_dir
    from .hf_source import HfSource, parse_hf_source
    from .patterns import compile_pattern
    from .safetensors_check import SafetensorsHeader, read_safetensors

_EXPORTS = {
    "HfSource": ".hf_source",
    "LoraSettings": ".adapter_config",
    "SafetensorsHeader": ".safetensors_check",
    "compile_pattern": ".patterns",
    "load_peft_dir": ".directory",
    "model_shapes": ".bases",
    "parse_config": ".adapter_config",
    "parse_hf_source": ".hf_source",
    "peft_files": ".directory",
    "read_safetensors": ".safetensors_check",
    "save_peft_dir": ".directory",
    "shapes_from_config": ".bases",
}

__all__ = [
    "HfSource",
    "LoraSettings",
    "SafetensorsHeader",
    "compile_pattern",
    "load_peft_dir",
    "model_shapes",
    "parse_config",
    "parse_hf_source",
    "peft_files",
    "read_safetensors",
    "save_peft_dir",
    "shapes_from_config",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
