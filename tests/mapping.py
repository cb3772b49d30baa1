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


def mapped_rss(t: torch.Tensor) -> int:
    """Resident bytes of the mapping that holds ``t``'s data, in this process (/proc/self/smaps, Linux)."""
    ptr = t.untyped_storage().data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own pages (whole pages inside its data) mapped in this process now: the present bit
    of each page in /proc/self/pagemap (Linux; readable without privileges)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    a, n = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-a // page), (a + n) // page
    if hi <= lo:
        return 0
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        raw = f.read((hi - lo) * 8)
    return page * sum(1 for (e,) in struct.iter_unpack("<Q", raw) if e >> 63)
