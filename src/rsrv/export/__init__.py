"""Turn models into rsrv bundles (see specs/export.md)."""

from rsrv.export.jax_export import ExportError, Input, Output, export_jax

__all__ = ["ExportError", "Input", "Output", "export_jax"]
