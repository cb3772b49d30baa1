"""``reflrl data download rotbench --dest D [--base-url URL]``: fetch RoTBench's first-turn files.

Files go to ``D/rotbench/first_turn/<level>.json`` (the layout ``--data-dir D`` expects). Each file is
downloaded to a temporary name, every record is checked (:func:`reflrl.eval.rotbench.load_level`),
then it is renamed into place; a bad file names the URL and the record.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import rotbench
from .data import DataError, file_sha256

ROTBENCH_URL = "https://raw.githubusercontent.com/Junjie-Ye/RoTBench/main/Data/First_Turn/"


def download_rotbench(dest: str | Path, base_url: str = ROTBENCH_URL, levels: tuple[str, ...] = rotbench.LEVELS,
                      timeout: float = 60.0, log=print) -> dict[str, str]:
    """Download and validate the level files; returns {level: sha256}."""
    import httpx

    out_dir = Path(dest) / "rotbench" / "first_turn"
    out_dir.mkdir(parents=True, exist_ok=True)
    base = base_url if base_url.endswith("/") else base_url + "/"
    hashes = {}
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        for lv in levels:
            url = f"{base}{lv}.json"
            final = out_dir / f"{lv}.json"
            tmp = out_dir / f".{lv}.json.part"
            try:
                with client.stream("GET", url) as r:
                    if r.status_code != 200:
                        raise DataError(f"{url}: HTTP {r.status_code}")
                    with open(tmp, "wb") as f:
                        for chunk in r.iter_bytes():
                            f.write(chunk)
            except httpx.HTTPError as e:
                tmp.unlink(missing_ok=True)
                raise DataError(f"{url}: {type(e).__name__}: {e}") from None
            try:
                check_dir = out_dir / ".check"
                check_dir.mkdir(exist_ok=True)
                os.replace(tmp, check_dir / f"{lv}.json")
                try:
                    rotbench.load_level(check_dir, lv)
                except DataError as e:
                    raise DataError(f"{url}: {e}") from None
                os.replace(check_dir / f"{lv}.json", final)
            finally:
                tmp.unlink(missing_ok=True)
                if (out_dir / ".check").exists():
                    for p in (out_dir / ".check").iterdir():
                        p.unlink()
                    (out_dir / ".check").rmdir()
            hashes[lv] = file_sha256(final)
            log(f"{lv}: {final} ({final.stat().st_size} bytes, sha256 {hashes[lv][:12]})")
    return hashes
