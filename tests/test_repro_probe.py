"""scripts/repro_probe.py: the hashes it prints follow the computation (same input, same hashes; another
model, other hashes), so equal and different lines mean what the README says they mean."""
from __future__ import annotations

import torch

from script_loader import load_script

probe = load_script("repro_probe")


def test_probe_is_repeatable_at_a_fixed_thread_count_and_follows_the_weights():
    before = torch.get_num_threads()
    try:
        a = probe.probe("tiny-random", "float32", "all", 1)
        b = probe.probe("tiny-random", "float32", "all", 1)
        assert a == b and set(a) == {"forward", "decode", "grad"}
        assert all(len(v) == 12 for v in a.values())
        c = probe.probe("tiny-random", "float32", "all", 1, seed=1)  # other weights, other bits
        assert c["forward"] != a["forward"] and c["grad"] != a["grad"]
    finally:
        torch.set_num_threads(before)
