"""Exporting a trained policy for other tools: bf16, compressed-tensors MXFP4 / NVFP4,
fp4rl's packed HiF4, and a directory vLLM serves with the fp4rl plug-in (see
``docs/integrations.md``, sections "Export" and "vLLM")."""

from fp4rl.export.exporter import (
    EXPORT_FORMATS,
    ExportResult,
    check_format,
    export_checkpoint,
    export_model,
    export_pretrained,
)
from fp4rl.export.registry import (
    ExportFormat,
    get_export_format,
    list_export_formats,
    register_export_format,
)
from fp4rl.export.targets import ExportError

__all__ = ["EXPORT_FORMATS", "ExportError", "ExportFormat", "ExportResult", "check_format",
           "export_checkpoint", "export_model", "export_pretrained", "get_export_format",
           "list_export_formats", "register_export_format"]
