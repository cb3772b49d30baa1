"""The run manifest (the efficiency paper (arXiv:2606.00135) sec. 3): everything that can move a tool-calling score, recorded.

model and weights hash, every seed, decoding parameters, each system prompt in full with its hash,
the multi-turn template (``native`` role messages vs ``context`` packed history), whether thinking
history is kept, the run size (a subset or every sample), each benchmark data file's hash and origin
(upstream repository, commit, path, licence), package versions, the command line.
"""
from __future__ import annotations

import hashlib
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .data import file_sha256, stored

#: manifest keys that name the evaluated model; ``compare`` warns about differences anywhere else.
MODEL_KEYS = ("model",)
#: keys that never matter for comparability
IGNORED_KEYS = ("created", "command", "out_dir", "timing", "data_dir", "run_size", "packages.git_sha", "packages.git_dirty",
                "packages.platform", "packages.torch_threads", "packages.cpu_count")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def package_versions() -> dict[str, Any]:
    """Python, torch, transformers, reflrl, git sha (reflrl.runlog.versions) + bfcl-eval, openai, tqdm."""
    try:
        from reflrl.runlog import versions

        out = dict(versions())
    except Exception:  # noqa: BLE001  torch-free environments
        out = {"python": platform.python_version()}
    for pkg in ("bfcl-eval", "openai", "tqdm", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def prompt_record(system_prompts: list[str], template: str | None = None) -> dict[str, Any]:
    """System prompts of one benchmark unit: the first in full, its hash, and a hash over all distinct
    ones (RoTBench/BFCL prompts embed each sample's tool list, so they differ per sample)."""
    distinct = sorted(set(system_prompts))
    rec: dict[str, Any] = {"count_distinct": len(distinct)}
    if template is not None:
        rec["template"] = template
        rec["template_sha256"] = sha256_text(template)
    if distinct:
        rec["first"] = system_prompts[0]
        rec["first_sha256"] = sha256_text(system_prompts[0])
        rec["all_sha256"] = sha256_text("\x00".join(distinct))
    return rec


def data_key(path: Path, roots: dict[str, Path]) -> str:
    """A machine-independent name for a data file: ``<label>/<path relative to that root>``."""
    p = Path(path).resolve()
    for label, root in roots.items():
        try:
            return f"{label}/{p.relative_to(Path(root).resolve()).as_posix()}"
        except ValueError:
            continue
    return str(p)


def data_hashes(paths: list[Path], roots: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: {"sha256", "bytes", "origin"}}`` of each existing file (names from :func:`data_key`; a
    benchmark file given as ``x.json`` may be stored as ``x.json.gz``, then ``content_sha256`` is the
    hash of the decompressed bytes). ``origin`` (:func:`reflrl.eval.sources.origin`): where a
    benchmark file came from; BFCL's files come with the installed bfcl-eval."""
    from . import sources

    out = {}
    for p in paths:
        real = stored(Path(p))
        if real is None:
            continue
        entry: dict[str, Any] = {"sha256": file_sha256(real), "bytes": real.stat().st_size}
        if real.suffix == ".gz":
            entry["content_sha256"] = sources.content_sha256(real)
        if "bfcl_eval" in real.parts:
            entry["origin"] = {"where": "bfcl-eval package", "version": _version("bfcl-eval")}
        else:
            entry["origin"] = sources.origin(real)
        out[data_key(real, roots or {})] = entry
    return out


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def build_manifest(*, model: dict[str, Any], seeds: list[int], decoding: dict[str, Any], template: str,
                   keep_thinking: bool, max_steps: int, benchmarks: list[str], limit: int | dict[str, int | None] | None,
                   options: dict[str, Any], prompts: dict[str, Any], data: dict[str, Any],
                   out_dir: str | None = None, data_dir: str | None = None,
                   seeds_per_benchmark: dict[str, list[int]] | None = None,
                   run_size: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "reflrl-eval-manifest",
        "format": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": list(sys.argv),
        "out_dir": out_dir,
        "data_dir": data_dir,
        "model": model,
        "seeds": list(seeds),
        "seeds_per_benchmark": {b: list(v) for b, v in (seeds_per_benchmark or {}).items()},
        "run_size": run_size,
        "decoding": decoding,
        "multi_turn_template": template,
        "keep_thinking_history": bool(keep_thinking),
        "max_steps_per_turn": max_steps,
        "benchmarks": list(benchmarks),
        "limit_per_subset": limit,
        "options": options,
        "system_prompts": prompts,
        "data": data,
        "packages": package_versions(),
    }


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b.c": leaf}."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def manifest_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Flattened keys whose values differ, other than the model and bookkeeping (see IGNORED_KEYS)."""
    fa, fb = flatten(a), flatten(b)
    diffs = []
    for k in sorted(set(fa) | set(fb)):
        top = k.split(".")[0]
        if top in MODEL_KEYS or any(k == i or k.startswith(i + ".") for i in IGNORED_KEYS):
            continue
        if fa.get(k, "<absent>") != fb.get(k, "<absent>"):
            diffs.append(k)
    return diffs
