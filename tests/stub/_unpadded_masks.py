"""The stub worker with transformers' SDPA causal-mask skip read as a GPU reads it.

``transformers.masking_utils._ignore_causal_mask_sdpa`` (5.x) skips the
explicit causal mask, leaving SDPA ``is_causal=True``, when the 2-D padding
mask has no padding: ``fast_all(padding_mask)``, i.e. ``tensor.sum() ==
tensor.numel()`` and ``bool()`` of it, a device read. BART's decoder builds an
all-ones mask when it gets none (``modeling_bart.py``: ``torch.ones(batch,
seq)``), so a GPU reads True and attends with ``is_causal=True``, as the
estimator traces it. On the stub the read gives 0: transformers builds a
boolean ``[b, 1, t, t]`` mask, and torch's composite SDPA converts it per
layer (``convert_boolean_attn_mask``, aten/src/ATen/native/transformers/
attention.cpp: ``where(mask, 0, -inf)``, kept as the mem-efficient kernel's
bias until backward): 2,048 B per decoder layer in fp32.

Here the same device ops run, then the GPU's answer for the harness's
unpadded rows is returned (as ``benchmarks/groundtruth/stub.py``'s
``_NEUTRALISERS`` do for other reads; this one belongs there). Run in the
stub environment: ``python -m tests.stub._unpadded_masks`` with
``benchmarks.groundtruth.run``'s worker arguments.
"""
from __future__ import annotations

import collections
import sys


def unpadded_causal_masks(neutralised: collections.Counter):
    """``_ignore_causal_mask_sdpa`` as a GPU answers it for rows without padding."""
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa

    def _ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
        if padding_mask is not None:
            masking_utils.fast_all(padding_mask)  # sum and compare on the device; a GPU reads True
            neutralised["transformers.masking_utils._ignore_causal_mask_sdpa"] += 1
        return original(None, *args, **kwargs)  # no padding: the answer a GPU reaches

    masking_utils._ignore_causal_mask_sdpa = _ignore_causal_mask_sdpa
    return lambda: setattr(masking_utils, "_ignore_causal_mask_sdpa", original)


if __name__ == "__main__":
    from benchmarks.groundtruth import run, stub

    stub._NEUTRALISERS = (*stub._NEUTRALISERS, unpadded_causal_masks)
    sys.exit(run.main(sys.argv[1:]))
