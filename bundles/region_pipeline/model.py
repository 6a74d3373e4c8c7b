"""Two stages with data-dependent Python in between.

region_scorer scores the 16 regions of the image; the glue keeps the TOP_K best regions
scoring above THRESHOLD (and stops early when there are none); patch_classifier labels
the crops of the kept regions.
"""

import numpy as np

import rsrv

PATCH, GRID, TOP_K, THRESHOLD = 16, 4, 4, 0.0


@rsrv.meta(inputs=["image"], outputs=["regions", "scores", "labels"])
def pipeline(call, image):
    scores = call("region_scorer", {"image": image[None]})["scores"][0]
    keep = np.flatnonzero(scores > THRESHOLD)
    if keep.size == 0:  # early exit: nothing worth classifying
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
    keep = keep[np.argsort(-scores[keep], kind="stable")][:TOP_K]
    rows, cols = np.divmod(keep, GRID)
    crops = np.stack([image[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
                      for r, c in zip(rows, cols)])
    logits = call("patch_classifier", {"crop": crops})["logits"]
    return keep.astype(np.int64), scores[keep], logits.argmax(axis=1).astype(np.int64)
