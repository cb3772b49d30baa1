"""One way to derive seeds from integer parts, for envs, faults drawn by envs, rollouts and the trainer.

``derive_seed(base, step, k)`` gives a seed that depends only on its parts (numpy's SeedSequence, the
same on every platform), so every random stream of a run (episode data, fault seeds, sampling, data
order, SFT batches) is a pure function of the run's seed and where it is drawn.
"""
from __future__ import annotations

import numpy as np

_MASK = 2**63 - 1


def derive_seed(*parts: int, bits: int = 63) -> int:
    """A ``bits``-bit seed (63 or 31) from integer parts; parts are taken modulo 2**63."""
    if bits not in (31, 63):
        raise ValueError(f"bits={bits}: expected 31 or 63")
    ss = np.random.SeedSequence([int(p) & _MASK for p in parts])
    if bits == 31:
        return int(ss.generate_state(1)[0] >> 1)
    return int(ss.generate_state(1, np.uint64)[0] >> np.uint64(1))
