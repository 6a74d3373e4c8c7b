"""Turn models into rsrv bundles (see specs/export.md).

One adapter per framework, all writing through :func:`export_program`:

* :func:`export_jax` - a JAX function ``fn(params, *inputs)`` and its parameter pytree;
* :func:`export_flax_nnx` - a Flax NNX module;
* :func:`export_flax_linen` - a Flax Linen module and its variables;
* :func:`export_equinox` - an Equinox module;
* :func:`export_torch` - a ``torch.nn.Module``, through ``torch.export`` and torchax;
* :func:`export_model` - whichever of the above fits the model's type.
"""

from rsrv.export.api import ExportSpec, export_model, export_spec, framework_of
from rsrv.export.equinox_export import export_equinox
from rsrv.export.errors import ExportError
from rsrv.export.flax_export import export_flax_linen, export_flax_nnx
from rsrv.export.jax_export import Input, Output, Program, export_jax, export_program
from rsrv.export.parity import Parity
from rsrv.export.provenance import collect_provenance
from rsrv.export.torch_export import export_torch, torch_unavailable_reason

__all__ = [
    "ExportError", "ExportSpec", "Input", "Output", "Parity", "Program", "collect_provenance",
    "export_equinox", "export_flax_linen", "export_flax_nnx", "export_jax", "export_model",
    "export_program", "export_spec", "export_torch", "framework_of", "torch_unavailable_reason",
]  # fmt: skip
