"""Turn models into rsrv bundles (see specs/export.md).

One adapter per framework, all writing through :func:`export_program`:

* :func:`export_jax` - a JAX function ``fn(params, *inputs)`` and its parameter pytree;
* :func:`export_flax_nnx` - a Flax NNX module;
* :func:`export_flax_linen` - a Flax Linen module and its variables;
* :func:`export_equinox` - an Equinox module;
* :func:`export_torch` - a ``torch.nn.Module``, through ``torch.export`` and torchax;
* :func:`export_model` - whichever of the above fits the model's type.
"""

from rsrv.export._api import (
    ExportSpec,
    add_arguments,
    export_main,
    export_model,
    export_spec,
    framework_of,
)
from rsrv.export._equinox import export_equinox
from rsrv.export._errors import ExportError
from rsrv.export._flax import export_flax_linen, export_flax_nnx
from rsrv.export._jax import export_jax
from rsrv.export._parity import Parity
from rsrv.export._program import Input, Output, Program, export_program
from rsrv.export._provenance import collect_provenance
from rsrv.export._torch import export_torch, torch_unavailable_reason

__all__ = [
    "ExportError", "ExportSpec", "Input", "Output", "Parity", "Program", "add_arguments",
    "collect_provenance", "export_main",
    "export_equinox", "export_flax_linen", "export_flax_nnx", "export_jax", "export_model",
    "export_program", "export_spec", "export_torch", "framework_of", "torch_unavailable_reason",
]  # fmt: skip
