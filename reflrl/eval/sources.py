"""Benchmark data with no manual step: what ships inside the package, what is downloaded on first use,
and where every file came from.

Shipped (``reflrl/benchdata/``, gzipped upstream bytes, read transparently by :mod:`reflrl.eval.data`):

* RoTBench first turn, all five levels, whole (Junjie-Ye/RoTBench, Apache-2.0);
* Seal-Tools test in-domain, test out-of-domain and the tool list, whole (fairyshine/Seal-Tools, Apache-2.0);
* TaskBench's three domains: ``tool_desc.json`` whole, and the first records of ``data.json`` (the gold
  task graphs; microsoft/JARVIS ``taskbench/``, MIT). The whole ``data.json`` files (several MB each)
  are not shipped: a run that needs more records than the subset holds (``--full``, or a ``--limit``
  above it) downloads them once from a pinned upstream commit into ``<cache>/benchdata/``.

A download (:func:`fetch`) streams to a temporary name, checks the size and hash pinned below (the
sha256 of the upstream bytes, or, where only the upstream tree was at hand, the git blob id the tree
names at the pinned commit), validates every record with the scorer's own loader, and only then
renames the file into place. Failures are :class:`DownloadError` subclasses that say what happened
(host unreachable, wrong hash, truncated, HTTP status) and how to run without a network
(:data:`DATA_DIR_LAYOUT`). ``$REFLRL_BENCHDATA_URL`` replaces ``https://raw.githubusercontent.com``
(a mirror with the same ``<owner>/<repo>/<commit>/<path>`` layout).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .data import DataError, file_sha256

RAW_BASE = "https://raw.githubusercontent.com"
ENV_BASE = "REFLRL_BENCHDATA_URL"

DATA_DIR_LAYOUT = """\
--data-dir DIR (or $REFLRL_BENCH_DATA) reads every benchmark of the run from DIR, laid out as upstream names the files:
  DIR/rotbench/first_turn/<level>.json               level: clean slight medium heavy union   (RoTBench Data/First_Turn/)
  DIR/taskbench/data_<domain>/data.json, tool_desc.json   domain: huggingface multimedia dailylifeapis   (microsoft/JARVIS taskbench/)
  DIR/seal-tools/test_in_domain.jsonl, test_out_domain.jsonl, tool.jsonl   (Seal-Tools Seal-Tools_Dataset/)
'reflrl data download BENCH --dest DIR' fills DIR on a machine with a network; 'reflrl data list' shows
what is shipped and cached."""


@dataclass(frozen=True)
class Upstream:
    """A public repository at a pinned commit."""

    repo: str
    commit: str
    license: str


ROTBENCH = Upstream("Junjie-Ye/RoTBench", "637e43ae9a978036774c92bb2ab11a83609e304b", "Apache-2.0")
SEALTOOLS = Upstream("fairyshine/Seal-Tools", "ce753ecd60ed08dd376984035de531ab8421f1c6", "Apache-2.0")
TASKBENCH = Upstream("microsoft/JARVIS", "c62e0faac76c4a2907cabe2cfe4bbe5f2e613400", "MIT")
#: a fork of microsoft/JARVIS whose indexed copy of ``data.json`` the shipped TaskBench subset was cut from
TASKBENCH_FORK = Upstream("laminair/JARVIS", "59cd0fdaf5ac7e285636e377ef5221d914176079", "MIT")


@dataclass(frozen=True)
class DataFile:
    """One benchmark file: where it sits under a data root (``layout``), where it comes from, its pins.

    ``part``: "whole" (the upstream file's bytes) or a description of the shipped excerpt.
    ``sha256``: of the bytes this entry stands for (None where only ``git_blob`` is known).
    ``git_blob``: the blob id upstream's tree names for ``path`` at the pinned commit (whole files).
    ``shipped``: the file's name under ``reflrl/benchdata/`` (None: downloaded on first use).
    """

    benchmark: str
    layout: str
    upstream: Upstream
    path: str
    part: str
    sha256: str | None
    git_blob: str | None
    size: int | None
    records: int | None
    shipped: str | None

    def url(self, base: str | None = None) -> str:
        base = (base or os.environ.get(ENV_BASE) or RAW_BASE).rstrip("/")
        return f"{base}/{self.upstream.repo}/{self.upstream.commit}/{self.path}"

    def origin(self) -> dict[str, Any]:
        """The manifest's account of where this file came from."""
        return {"repository": self.upstream.repo, "commit": self.upstream.commit, "path": self.path,
                "url": self.url(RAW_BASE), "license": self.upstream.license, "part": self.part,
                "upstream_sha256": self.sha256 if self.part == "whole" else None,
                "upstream_git_blob": self.git_blob}


def _rot(level: str, sha: str, blob: str, size: int, n: int) -> DataFile:
    return DataFile("rotbench", f"rotbench/first_turn/{level}.json", ROTBENCH, f"Data/First_Turn/{level}.json",
                    "whole", sha, blob, size, n, f"rotbench/first_turn/{level}.json.gz")


def _seal(name: str, sha: str, blob: str, size: int, n: int) -> DataFile:
    return DataFile("sealtools", f"seal-tools/{name}", SEALTOOLS, f"Seal-Tools_Dataset/{name}", "whole", sha, blob,
                    size, n, f"seal-tools/{name}.gz")


def _tool_desc(domain: str, sha: str, blob: str, size: int) -> DataFile:
    return DataFile("taskbench", f"taskbench/data_{domain}/tool_desc.json", TASKBENCH,
                    f"taskbench/data_{domain}/tool_desc.json", "whole", sha, blob, size, None,
                    f"taskbench/data_{domain}/tool_desc.json")


def _tb_subset(domain: str, sha: str, size: int, n: int) -> DataFile:
    return DataFile("taskbench", f"taskbench/data_{domain}/data.json", TASKBENCH_FORK,
                    f"taskbench/data_{domain}/data.json",
                    f"first {n} records (lines unmodified, upstream order)", sha, None, size, n,
                    f"taskbench/data_{domain}/data.json.gz")


def _tb_full(domain: str, blob: str) -> DataFile:
    return DataFile("taskbench", f"taskbench/data_{domain}/data.json", TASKBENCH, f"taskbench/data_{domain}/data.json",
                    "whole", None, blob, None, None, None)


#: every file shipped in ``reflrl/benchdata/``
SHIPPED: tuple[DataFile, ...] = (
    _rot("clean", "a367dc165c0bb09f4002c89ab9a6884ef2383547d8e6d21511c7c0153e7ff1cd",
         "be3cfffe7d537ebad1b9c03c787e1189252895be", 723197, 105),
    _rot("slight", "a47aee08eec1d6b9519c227829a076ce05e2737455e0d7589921460f8cbe9825",
         "f501428f5699d730c89fb54f7ba632c0336a22b5", 1446347, 210),
    _rot("medium", "ad73ad3cad2ecd76bd2f0a2c7fb6e8dd3f599d20b6177b07ab5ad5fe6330e4be",
         "14b71af25a23b5eac2b7d90eee68170cb690ef62", 1438862, 210),
    _rot("heavy", "061ffc421a9fa8b51abacfeab6880d42b86661d529e048f0cb09f2bee527533b",
         "b1023c7ceb403536e1eb2c36e6d003571042b244", 1478027, 210),
    _rot("union", "61ffacb834ebaac9aa317eb45e1e8b8c3f2c659696139b9dd3b7272491cff911",
         "022bbffbe2bb9171167ad474c1bab3678e291346", 730173, 105),
    _seal("test_in_domain.jsonl", "330020288948e711846417c2fca9a5980ef0f1adc01ad74dc38cc9ff7142811f",
          "66482d276618155d764b7fd8f7f13dcdf1aeee12", 511226, 700),
    _seal("test_out_domain.jsonl", "c2a86a3d3a5270f578e07f39a0973310cbcaec3b8d72166d7be38d21c9720be6",
          "ec857c6ab87cf72c600d8a33cd77e52ae109cda1", 542260, 654),
    _seal("tool.jsonl", "35e34aaec1f0793c2b5a5dff734cb925837988f59ed0fe4f410d67f3d8375f5c",
          "f84f2924bb3f6bba4c258836c46a6f9babc7f2d7", 2574022, 4076),
    _tool_desc("huggingface", "0eb0654faea9a5f07c0102ca57bfc6de3f9e03d8a00c2776b82e22b1b7c31fbd",
               "e9d952c7dd74f6564c17f1b9b784f7f807e08506", 7878),
    _tool_desc("multimedia", "6300f287ebf7dd04f7e8f4d76462b2fe83b823f1cccf432608818f3df67ed0d7",
               "1017ec3f33325a3ed6b6b7601d2adf6b0970d43f", 9043),
    _tool_desc("dailylifeapis", "64b3ed4f0f3ad199d817695bc3bb7e2f7d9bc2cae2f310821744a62ae41aee13",
               "c79202fcf0ade9b1f64f8d96ef7f18f180b8a15d", 14069),
    _tb_subset("huggingface", "0d3a8eaaf509849683d2f1419cc86a05a4090a6f57d5e438d9c831d28aff24f0", 48229, 45),
    _tb_subset("multimedia", "ab4f31e0774a42bfe254c60c52142ab1ce7f991979ada9bbd571e8cc85b38102", 48744, 46),
    _tb_subset("dailylifeapis", "c1107bb87204f1ffb879e246aa59ec809a3422b6a5b624c65abb2071b36b4416", 48405, 36),
)

#: TaskBench's whole gold files, downloaded on first use (pinned by the blob ids of upstream's tree)
TASKBENCH_FULL: dict[str, DataFile] = {
    "huggingface": _tb_full("huggingface", "4c545595480bf029328ef7453ce114f78a6539ff"),
    "multimedia": _tb_full("multimedia", "9d6f07d1ba0f7f09ee8180fd05ee95cf42661a47"),
    "dailylifeapis": _tb_full("dailylifeapis", "ea5e70584a144d1ff7a9a246805bab7c7fe0f511"),
}

#: records of TaskBench's data.json shipped per domain
TASKBENCH_SHIPPED = {f.layout.split("/")[1].removeprefix("data_"): f.records for f in SHIPPED
                     if f.layout.endswith("/data.json")}


# ------------------------------------------------------------------------------------ locations
def package_root() -> Path:
    """``reflrl/benchdata``: the shipped files, in the ``--data-dir`` layout (gzipped)."""
    return Path(__file__).resolve().parent.parent / "benchdata"


def cache_dir() -> Path:
    """``<cache>/benchdata`` (``$REFLRL_CACHE`` or ``~/.cache/reflrl``): downloaded files."""
    from reflrl.paths import cache_root

    return cache_root() / "benchdata"


def download_root(upstream: Upstream) -> Path:
    """Where the whole files of ``upstream`` are cached: ``<cache>/benchdata/<owner>+<repo>/<commit>``
    (a data root: ``taskbench/data_<domain>/`` below it)."""
    return cache_dir() / upstream.repo.replace("/", "+") / upstream.commit


# ------------------------------------------------------------------------------------ errors
class DownloadError(DataError):
    """A benchmark file could not be downloaded or was refused; the message names the URL."""


class Unreachable(DownloadError):
    """No connection to the host (no network, a proxy that refuses, DNS failure, timeout)."""


class HTTPStatus(DownloadError):
    """The server answered with an HTTP status other than 200."""


class Truncated(DownloadError):
    """The body ended before the announced or pinned size."""


class ChecksumMismatch(DownloadError):
    """The bytes' hash is not the pinned one; nothing is kept."""


class InvalidRecords(DownloadError):
    """The file downloaded with the right size but a record fails the scorer's checks."""


# ------------------------------------------------------------------------------------ hashes
def git_blob_id_of_bytes(data: bytes) -> str:
    """git's object id of ``data``: sha1 of ``blob <size>\\0`` + the bytes."""
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


def git_blob_id(path: Path) -> str:
    """git's object id of a file's bytes: sha1 of ``blob <size>\\0`` + the bytes."""
    h = hashlib.sha1()
    h.update(f"blob {Path(path).stat().st_size}\0".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_sha256(path: Path) -> str:
    """sha256 of a file's content (of the decompressed bytes for a ``.gz`` file)."""
    path = Path(path)
    if path.suffix != ".gz":
        return file_sha256(path)
    h = hashlib.sha256()
    with gzip.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_pins(entry: DataFile, path: Path, url: str = "") -> str:
    """Raise :class:`Truncated` / :class:`ChecksumMismatch` unless ``path`` holds ``entry``'s bytes;
    returns their sha256."""
    where = url or str(path)
    size = Path(path).stat().st_size
    if entry.size is not None and size < entry.size:
        raise Truncated(f"{where}: truncated: {size} of {entry.size} bytes")
    sha = file_sha256(path)
    if entry.sha256 is not None and sha != entry.sha256:
        raise ChecksumMismatch(f"{where}: sha256 {sha} is not the pinned {entry.sha256} "
                               f"({entry.upstream.repo}@{entry.upstream.commit[:12]}:{entry.path}); file not kept")
    if entry.sha256 is None and entry.git_blob is not None:
        blob = git_blob_id(path)
        if blob != entry.git_blob:
            raise ChecksumMismatch(f"{where}: git blob id {blob} is not the pinned {entry.git_blob} "
                                   f"({entry.upstream.repo}@{entry.upstream.commit[:12]}:{entry.path}); "
                                   "file not kept")
    return sha


# ------------------------------------------------------------------------------------ validation
def validate(entry: DataFile, path: Path) -> int:
    """Check every record of ``path`` (a file standing for ``entry``) with the scorer's loader;
    returns the number of records. DataError names the file and record."""
    from . import rotbench, sealtools, taskbench

    name = entry.layout.rsplit("/", 1)[-1]
    gz = ".gz" if Path(path).suffix == ".gz" else ""  # a shipped file: the loaders read it as name.gz
    with tempfile.TemporaryDirectory(prefix="reflrl-check-") as tmp:
        root = Path(tmp)
        if entry.benchmark == "rotbench":
            level = name.removesuffix(".json")
            (root / "first_turn").mkdir()
            os.symlink(Path(path).resolve(), root / "first_turn" / f"{level}.json{gz}")
            return len(rotbench.load_level(root, level))
        if entry.benchmark == "sealtools":
            if name.startswith("tool"):
                return len(sealtools.load_tools_file(path))
            return len(sealtools.check_split(path))
        if name == "tool_desc.json":
            domain = entry.layout.split("/")[1].removeprefix("data_")
            (root / f"data_{domain}").mkdir()
            os.symlink(Path(path).resolve(), root / f"data_{domain}" / f"tool_desc.json{gz}")
            taskbench.load_tool_desc(root, domain)
            return 1
        domain = entry.layout.split("/")[1].removeprefix("data_")
        (root / f"data_{domain}").mkdir()
        os.symlink(Path(path).resolve(), root / f"data_{domain}" / f"data.json{gz}")
        return len(taskbench.load_domain(root, domain))
    raise DataError(f"{entry.layout}: no validator")  # pragma: no cover


# ------------------------------------------------------------------------------------ download
def fetch(entry: DataFile, dest: Path, *, base_url: str | None = None, timeout: float = 60.0,
          log: Callable[[str], None] = print) -> str:
    """Download ``entry`` to ``dest`` (atomically: nothing is left at ``dest`` on failure); returns
    the sha256 of the bytes. Raises a :class:`DownloadError` subclass."""
    import httpx

    url = entry.url(base_url)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        try:
            with httpx.Client(timeout=timeout, follow_redirects=True) as client, client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise HTTPStatus(f"{url}: HTTP {r.status_code}")
                announced = r.headers.get("content-length")
                got = 0
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                        got += len(chunk)
                if announced is not None and got < int(announced) and not r.headers.get("content-encoding"):
                    raise Truncated(f"{url}: truncated: {got} of {announced} bytes")
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol) as e:
            raise Unreachable(f"{url}: cannot connect ({type(e).__name__}: {e})") from None
        except httpx.TimeoutException as e:
            raise Unreachable(f"{url}: timed out ({type(e).__name__})") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise Truncated(f"{url}: the connection ended early ({type(e).__name__}: {e})") from None
        except httpx.HTTPError as e:
            raise DownloadError(f"{url}: {type(e).__name__}: {e}") from None
        sha = check_pins(entry, tmp, url)
        try:
            n = validate(entry, tmp)
        except DataError as e:
            raise InvalidRecords(f"{url}: {e}") from None
        os.replace(tmp, dest)
        log(f"[reflrl data] {entry.layout}: {n} records, {dest.stat().st_size} bytes, sha256 {sha[:12]} "
            f"(from {url})")
        return sha
    finally:
        tmp.unlink(missing_ok=True)


def ensure_taskbench_full(domain: str, *, base_url: str | None = None, timeout: float = 60.0,
                          log: Callable[[str], None] = print) -> Path:
    """The data root holding TaskBench ``domain``'s whole ``data.json`` (and its ``tool_desc.json``):
    the cache, downloading the file on first use. A cached file is re-checked against its pin."""
    entry = TASKBENCH_FULL[domain]
    root = download_root(entry.upstream)
    dest = root / entry.path
    if dest.is_file():
        try:
            check_pins(entry, dest)
        except DownloadError:
            log(f"[reflrl data] {dest}: does not match its pin; downloading it again")
            dest.unlink()
    if not dest.is_file():
        log(f"[reflrl data] TaskBench {domain}: the whole data.json is not shipped; downloading it once "
            f"into {root}")
        try:
            fetch(entry, dest, base_url=base_url, timeout=timeout, log=log)
        except DownloadError as e:
            raise type(e)(f"{e}\nTaskBench {domain} needs its whole data.json for --full or a --limit above "
                          f"the {TASKBENCH_SHIPPED[domain]} records shipped; without a network run with "
                          f"--limit {TASKBENCH_SHIPPED[domain]} or less, or pass --data-dir.\n"
                          f"{DATA_DIR_LAYOUT}") from None
    desc = next(f for f in SHIPPED if f.layout == f"taskbench/data_{domain}/tool_desc.json")
    desc_dest = root / "taskbench" / f"data_{domain}" / "tool_desc.json"
    if not desc_dest.is_file() or file_sha256(desc_dest) != desc.sha256:
        shutil.copyfile(package_root() / desc.shipped, desc_dest)
    return root


def download(benchmark: str, dest: Path, *, base_url: str | None = None, timeout: float = 60.0,
             domains: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, str]:
    """``reflrl data download --dest``: the whole upstream files of ``benchmark`` into the data root
    ``dest`` (its ``--data-dir`` layout; TaskBench: of ``domains``, default all); returns {layout path: sha256}."""
    if benchmark == "taskbench":
        doms = domains or list(TASKBENCH_FULL)
        entries = [f for f in SHIPPED if f.benchmark == "taskbench" and f.part == "whole"
                   and f.layout.split("/")[1].removeprefix("data_") in doms]
        entries += [TASKBENCH_FULL[d] for d in doms]
    else:
        entries = [f for f in SHIPPED if f.benchmark == benchmark and f.part == "whole"]
    if not entries:
        raise DataError(f"unknown benchmark {benchmark!r} (rotbench, taskbench, sealtools)")
    out = {}
    for e in entries:
        out[e.layout] = fetch(e, Path(dest) / e.layout, base_url=base_url, timeout=timeout, log=log)
    return out


# ------------------------------------------------------------------------------------ roots and origins
def roots_for(benchmarks: list[str], *, limits: dict[str, int | None], domains: list[str] | None = None,
              base_url: str | None = None, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Data roots when no ``--data-dir`` is given: ``{"rotbench": root, "sealtools": root,
    "taskbench/<domain>": root}``. Shipped data where it covers the run; TaskBench's whole files are
    downloaded (once) where ``limits["taskbench"]`` is None (all records) or above the shipped subset."""
    from . import taskbench

    roots: dict[str, Path] = {}
    pkg = package_root()
    for b in benchmarks:
        if b in ("rotbench", "sealtools"):
            roots[b] = pkg
        elif b == "taskbench":
            limit = limits.get("taskbench")
            for dom in domains or list(taskbench.DOMAINS):
                if dom not in TASKBENCH_SHIPPED:
                    raise ValueError(f"unknown TaskBench domain {dom!r}; expected one of {taskbench.DOMAINS}")
                if limit is not None and limit <= TASKBENCH_SHIPPED[dom]:
                    roots[f"taskbench/{dom}"] = pkg
                else:
                    roots[f"taskbench/{dom}"] = ensure_taskbench_full(dom, base_url=base_url, log=log)
    return roots


def origin(path: Path, roots: dict[str, Path] | None = None) -> dict[str, Any]:
    """Where a data file came from: a shipped or cached file by its place, any other by its content
    (``matches`` names the pinned upstream file it equals, if any)."""
    p = Path(path).resolve()
    pkg = package_root().resolve()
    try:
        rel = p.relative_to(pkg).as_posix()
    except ValueError:
        rel = None
    if rel is not None:
        for f in SHIPPED:
            if f.shipped == rel:
                return {"where": "shipped with reflrl", **f.origin()}
    for f in TASKBENCH_FULL.values():
        if p == (download_root(f.upstream) / f.path).resolve():
            return {"where": "downloaded on first use (cache)", **f.origin()}
    sha = content_sha256(p)
    for f in (*SHIPPED, *TASKBENCH_FULL.values()):
        if f.sha256 == sha:
            return {"where": "--data-dir", "matches": f.origin()}
    return {"where": "--data-dir", "matches": None}


def cached_or_shipped() -> list[dict[str, Any]]:
    """``reflrl data list``: every known file, whether it is shipped or cached, and its origin."""
    rows = []
    for f in SHIPPED:
        p = package_root() / f.shipped
        rows.append({"layout": f.layout, "status": "shipped" if p.is_file() else "MISSING from the package",
                     "records": f.records, "part": f.part, "path": str(p), **f.origin()})
    for dom, f in TASKBENCH_FULL.items():
        p = download_root(f.upstream) / f.path
        rows.append({"layout": f.layout + " (whole)", "status": "cached" if p.is_file() else "downloaded on first use",
                     "records": None, "part": f.part, "path": str(p), **f.origin()})
    return rows
