"""Turn CORAL ordinal logits into a severity grade.

The grade is the number of leading thresholds whose logit is positive; counting stops at
the first one that is not. The early break is a plain Python loop next to the model.
"""

import numpy as np

import rsrv


@rsrv.postprocess(inputs=["logits"], outputs=["grade"])
def grade(logits: np.ndarray) -> np.ndarray:
    out = np.zeros(logits.shape[0], np.int64)
    for row, values in enumerate(logits):
        count = 0
        for value in values:
            if value <= 0.0:
                break
            count += 1
        out[row] = count
    return out
