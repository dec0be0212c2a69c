"""More steps of the same stream: the traced last iteration played again, until the allocator settles.

The trace holds :data:`llmem_plugin.trace.step.NUM_ITERATIONS` training steps. From
the second on, a step makes the same requests in the same order (the optimizer's
states exist by then), but the caching allocator need not be in the same state
after it as before it: where ties between equal-size free blocks go to the newest
segment (torch <= 2.12 on a GPU, ``AllocatorConfig.large_segments_descend``), the
blocks a step leaves free can sit elsewhere than the step before found them, and a
later step can need a new segment (the H200 fp32 Llama-3.2-1B row: +1002 MiB at
step 3). :func:`repeat_last_iteration` builds step 3, 4, ... from the traced last
step, so the replay can run until reserved stops growing.

The last step's frees of tensors made before it (the previous step's gradients,
loss, ...) are paired with the tensors it leaves live at its end, in allocation
order and size for size: step k+1 frees what step k made where step k freed what
step k-1 made. When they do not pair up, the stream is not a repeating one and
None is returned.
"""

from __future__ import annotations

__all__ = ["repeat_last_iteration"]


def repeat_last_iteration(events: list[tuple[int, int, int]], start: int, times: int
                          ) -> list[tuple[int, int, int]] | None:
    """``events`` with ``events[start:]`` (the last traced step) played ``times`` more, keys renamed.

    Returns:
        The longer stream, or None where the last step's frees of older tensors
        do not pair, size for size, with the tensors it leaves live.
    """
    born: dict[int, int] = {}  # key -> position of its allocation
    for j, (sign, key, _) in enumerate(events):
        if sign > 0:
            born[key] = j
    size = {key: nbytes for sign, key, nbytes in events if sign > 0}
    last = events[start:]
    made = {key for sign, key, _ in last if sign > 0}
    freed = {key for sign, key, _ in last if sign < 0}
    older = sorted((k for k in freed if k not in made and k in born), key=born.__getitem__)
    left = sorted((k for k in made if k not in freed), key=born.__getitem__)
    if len(older) != len(left) or any(size[a] != size[b] for a, b in zip(older, left)):
        return None
    out = list(events)
    top = max((abs(k) for k in size), default=0) + 1
    prev = {old: new for old, new in zip(older, left)}  # an older key -> this copy's live key
    for n in range(1, times + 1):
        rename = {k: k + n * top if k >= 0 else k - n * top for k in made}
        for sign, key, nbytes in last:
            if sign > 0:
                out.append((sign, rename[key], nbytes))
            else:
                out.append((sign, rename[key] if key in made else prev.get(key, key), nbytes))
        prev = {old: rename[new] for old, new in zip(older, left)}
    return out
