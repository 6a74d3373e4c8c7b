"""Building a batch's inputs from its requests, and slicing its outputs back.

Each executable tensor is concatenated along its *own* batch axis (a model may
take one input as ``[n, c]`` and another as ``[c, n]``); padding is zero rows
appended after the last request. Outputs are sliced per request along each
output's batch axis, so padding rows never reach a request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rsrv.errors import Internal, InvalidArgument


def signature(inputs: Sequence[np.ndarray], axes: Sequence[int | None], model: str) -> tuple:
    """What must match for two requests to share a batch: per input, its dtype and
    its shape without the batch axis. Raises InvalidArgument if an input lacks its
    batch axis."""
    sig = []
    for j, (x, axis) in enumerate(zip(inputs, axes, strict=True)):
        if axis is None:
            sig.append((x.dtype.str, x.shape))
            continue
        if axis >= x.ndim:
            raise InvalidArgument(
                f"model {model!r}: input {j} has shape {list(x.shape)}, without batch axis {axis}"
            )
        sig.append((x.dtype.str, x.shape[:axis] + x.shape[axis + 1 :]))
    return tuple(sig)


def rows_of(inputs: Sequence[np.ndarray], axes: Sequence[int], model: str) -> int:
    """The common extent of ``inputs`` along their batch axes; InvalidArgument if
    they disagree."""
    extents = {int(x.shape[a]) for x, a in zip(inputs, axes, strict=True)}
    if len(extents) != 1:
        shown = ", ".join(
            f"input {j}: {x.shape[a]}" for j, (x, a) in enumerate(zip(inputs, axes, strict=True))
        )
        raise InvalidArgument(f"model {model!r}: inputs disagree on the batch size ({shown})")
    return extents.pop()


def assemble(
    parts: Sequence[Sequence[np.ndarray]], rows: int, size: int, axes: Sequence[int]
) -> list[np.ndarray]:
    """Batch inputs: per tensor j, ``parts[r][j]`` of each request r concatenated
    along ``axes[j]``, then ``size - rows`` zero rows. A lone request that fills the
    size is passed through without a copy."""
    batch = []
    pad = size - rows
    for j, axis in enumerate(axes):
        pieces = [p[j] for p in parts]
        if pad:
            shape = list(pieces[0].shape)
            shape[axis] = pad
            pieces.append(np.zeros(shape, pieces[0].dtype))
        batch.append(pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis))
    return batch


def check_count(outputs: Sequence[np.ndarray], expected: int, model: str) -> None:
    """Internal when the executor returned other than ``expected`` outputs."""
    if len(outputs) != expected:
        raise Internal(
            f"model {model!r}: the executable returned {len(outputs)} outputs, expected {expected}"
        )


def split(
    outputs: Sequence[np.ndarray], counts: Sequence[int], size: int, axes: Sequence[int], model: str
) -> list[list[np.ndarray]]:
    """Per request, its rows of every output (views), in request order.

    Raises Internal when the executor returned the wrong number of outputs or an
    output without ``size`` rows on its batch axis.
    """
    check_count(outputs, len(axes), model)
    for k, (out, axis) in enumerate(zip(outputs, axes, strict=True)):
        if out.ndim <= axis or out.shape[axis] != size:
            raise Internal(
                f"model {model!r}: output {k} has shape {list(out.shape)}, "
                f"expected {size} rows on axis {axis}"
            )
    per_request = []
    start = 0
    for n in counts:
        rows = slice(start, start + n)
        per_request.append(
            [out[(slice(None),) * axis + (rows,)] for out, axis in zip(outputs, axes, strict=True)]
        )
        start += n
    return per_request
