"""Threads on a busy machine: the reflrl command makes waiting OpenMP threads sleep (so another process
costs a proportional slowdown, not a collapse) without changing anything a user's own import sees."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reflrl.threads import (MALLOC_ARENAS, ONEDNN_CACHE, WAIT_POLICY, configure_onednn, configure_openmp,
                            limit_malloc_arenas)

ROOT = Path(__file__).resolve().parent.parent


def test_configure_openmp_sets_passive_unless_the_user_chose():
    env: dict[str, str] = {}
    assert configure_openmp(env) == WAIT_POLICY == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert configure_openmp(mine) is None and mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def _run(code: str, **env_over: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env.update(env_over)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_reflrl_command_sets_it_before_torch_loads_and_a_plain_import_does_not():
    cmd = ("import os, sys; from reflrl.cli import main; main(['faults', 'list']); "
           "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    assert _run(cmd).endswith("PASSIVE False")  # set, and torch not yet loaded (so OpenMP will read it)
    assert _run(cmd, OMP_WAIT_POLICY="ACTIVE").endswith("ACTIVE False")  # the user's choice wins
    assert _run("import os, reflrl, reflrl.train; print(os.environ.get('OMP_WAIT_POLICY'))") == "None"
    caps = ("import os; from reflrl.cli import main; main(['faults', 'list']); "
            "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'))")
    assert _run(caps) == f"{ONEDNN_CACHE} {ONEDNN_CACHE}"  # the command caps oneDNN's caches too


def test_a_run_started_as_the_scripts_start_it_records_its_thread_settings(tmp_path):
    """`python -m reflrl train` (how the benchmark and table scripts start runs) gets the policy, and the
    run's summary says which threads and policy it ran with."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-m", "reflrl", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
                          "--name", "t", "--no-report", "--no-progress", "--quiet", "--set", f"train.out_dir={tmp_path}",
                          "--set", "train.steps=1", "--set", "data.n_test=2"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert s["omp_wait_policy"] == "PASSIVE" and s["threads"] == 1  # tiny.yaml fixes 1 thread


_SHAPES = """
import ctypes, gc, os, sys
from reflrl.threads import configure_onednn
if sys.argv[1] == 'capped':
    configure_onednn()
import torch, torch.nn.functional as F
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                               'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL('libc.so.6'); libc.mallinfo2.restype = MI
def used():
    gc.collect(); return libc.mallinfo2().uordblks
w = torch.randn(256, 64).bfloat16()
F.linear(torch.randn(3, 64).bfloat16(), w)
before = used()
for m in range(16, 16 + 600):  # a new row count every call, as prefills and micro-batches have
    F.linear(torch.randn(m, 64).bfloat16(), w)
print((used() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(),
                    reason="measures glibc's heap through mallinfo2 around oneDNN products")
def test_capped_onednn_caches_keep_the_heap_that_new_product_shapes_leave_bounded():
    """600 bfloat16 products of 600 row counts: uncapped, oneDNN's caches keep each shape's primitive
    (hundreds of MB over a run); capped at ONEDNN_CACHE entries the heap stays flat."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    grown = {mode: int(subprocess.run([sys.executable, "-c", _SHAPES, mode], capture_output=True, text=True,
                                      env=env, timeout=300, check=True).stdout.split()[-1])
             for mode in ("capped", "default")}
    assert grown["default"] >= 50  # MB: what the cap is for (about 0.5 MB per shape here)
    assert grown["capped"] <= grown["default"] // 3  # at most ONEDNN_CACHE shapes kept of 600


def test_configure_onednn_caps_both_caches_unless_the_user_chose():
    env: dict[str, str] = {}
    assert configure_onednn(env) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"]
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE), "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE)}
    mine = {"LRU_CACHE_CAPACITY": "4096"}
    assert configure_onednn(mine) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] and mine["LRU_CACHE_CAPACITY"] == "4096"


_ARENAS = """
import ctypes, sys, tempfile, threading
from reflrl.threads import limit_malloc_arenas
print(limit_malloc_arenas() if sys.argv[1] == 'limited' else 'default')
bar = threading.Barrier(6)
def work():
    keep = [bytearray(200000) for _ in range(5)]  # from this thread's heap arena
    bar.wait()  # all six hold theirs at once
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL('libc.so.6'); libc.fopen.restype = ctypes.c_void_p
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b'w'); libc.malloc_info(0, ctypes.c_void_p(f)); libc.fclose(ctypes.c_void_p(f))
print(open(path).read().count('<heap nr='))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas, counted by malloc_info")
def test_limited_malloc_arenas_keep_six_allocating_threads_in_two_heaps():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    out = {mode: subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, env=env,
                                timeout=120, check=True).stdout.split() for mode in ("limited", "default")}
    assert out["limited"] == ["True", str(MALLOC_ARENAS)]
    assert int(out["default"][1]) > MALLOC_ARENAS  # what the limit is for: one arena per allocating thread
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "8"}) is False  # the user's choice stays
    assert limit_malloc_arenas({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) is False
