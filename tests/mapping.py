"""Where a tensor's memory lives, for the tests of data moved to mapped files (reflrl.memory.map_to_disk)."""
from __future__ import annotations

import torch


def mapped_file(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s data ('' for the heap): from /proc/self/maps (Linux)."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return ""
