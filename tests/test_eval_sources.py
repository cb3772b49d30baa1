"""Benchmark data with no manual step: the shipped files are the pinned upstream bytes and pass every
record check; downloads from a real HTTP server on 127.0.0.1 are kept only when whole, pinned and
valid (good file, bad hash, truncated body, short file, bad record, HTTP error, unreachable host);
the whole TaskBench files are cached on first use and re-checked; origins reach the manifest."""
from __future__ import annotations

import dataclasses
import gzip
import http.server
import json
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from reflrl.eval import rotbench, sealtools, sources as S, taskbench
from reflrl.eval.data import DataError, file_sha256, read_json

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "benchmarks"
TB_FIXTURE = FIXTURES / "taskbench" / "data_huggingface" / "data.json"
TB_RECORDS = len(TB_FIXTURE.read_text().splitlines())


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files[path] = (bytes, mode)``; mode "cut" announces the whole length but
    sends half the body and closes the connection."""

    def do_GET(self):  # noqa: N802
        item = self.server.files.get(self.path)
        self.server.requests.append(self.path)
        if item is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, mode = item
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "cut":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files, srv.requests = {}, []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def tb_entry(body: bytes, *, by: str = "sha256", domain: str = "huggingface") -> S.DataFile:
    """A TaskBench data.json entry pinned to ``body`` (by sha256 or by git blob id)."""
    import hashlib

    sha = hashlib.sha256(body).hexdigest()
    blob = hashlib.sha1(f"blob {len(body)}\0".encode() + body).hexdigest()
    base = S.TASKBENCH_FULL[domain]
    return dataclasses.replace(base, sha256=sha if by == "sha256" else None, git_blob=blob,
                               size=len(body) if by == "sha256" else None)


def serve(srv, entry: S.DataFile, body: bytes, mode: str = "ok") -> None:
    srv.files[f"/{entry.upstream.repo}/{entry.upstream.commit}/{entry.path}"] = (body, mode)


# ------------------------------------------------------------------------------- shipped data
def test_shipped_files_are_the_pinned_upstream_bytes_and_every_record_passes():
    root = S.package_root()
    assert {f.benchmark for f in S.SHIPPED} == {"rotbench", "sealtools", "taskbench"}
    for f in S.SHIPPED:
        path = root / f.shipped
        assert path.is_file(), f.shipped
        assert S.content_sha256(path) == f.sha256, f.layout
        if f.part == "whole":
            with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as fh:
                data = fh.read()
            assert len(data) == f.size
            assert S.git_blob_id_of_bytes(data) == f.git_blob, f.layout
        n = S.validate(f, path)
        if f.records is not None:
            assert n == f.records, f.layout
    for bench in ("rotbench", "seal-tools", "taskbench"):
        assert (root / bench / "LICENSE").is_file()
    attribution = (root / "ATTRIBUTION.md").read_text()
    for f in S.SHIPPED:
        assert f.upstream.commit in attribution and f.sha256 in attribution, f.layout


def test_loaders_read_the_gzipped_package_as_a_data_dir():
    root = S.package_root()
    assert [len(rotbench.load_level(root, lv)) for lv in rotbench.LEVELS] == [105, 210, 210, 210, 105]
    tools = sealtools.load_tools(root)
    splits = sealtools.split_files(root)
    assert [p.name for p in splits] == ["test_in_domain.jsonl", "test_out_domain.jsonl"]
    assert [len(sealtools.load_split(p, tools)) for p in splits] == [700, 654]
    assert {d: len(taskbench.load_domain(root, d)) for d in taskbench.DOMAINS} == S.TASKBENCH_SHIPPED


# ------------------------------------------------------------------------------- fetch
def test_fetch_keeps_a_good_file_pinned_by_sha256_or_git_blob(server, tmp_path):
    body = TB_FIXTURE.read_bytes()
    logs = []
    for by in ("sha256", "git_blob"):
        entry = tb_entry(body, by=by)
        serve(server, entry, body)
        dest = tmp_path / by / "data.json"
        sha = S.fetch(entry, dest, base_url=server.base, log=logs.append)
        assert dest.read_bytes() == body and sha == file_sha256(dest)
        assert list(dest.parent.iterdir()) == [dest]  # no .part left behind
    assert f"{TB_RECORDS} records" in logs[0] and server.base in logs[0]


def test_fetch_refuses_a_bad_hash_and_keeps_nothing(server, tmp_path):
    body = TB_FIXTURE.read_bytes()
    for by in ("sha256", "git_blob"):
        entry = tb_entry(body, by=by)
        tampered = body.replace(b"Automatic", b"Automatik", 1)
        serve(server, entry, tampered)
        dest = tmp_path / by / "data.json"
        with pytest.raises(S.ChecksumMismatch, match="not the pinned") as e:
            S.fetch(entry, dest, base_url=server.base, log=lambda m: None)
        assert server.base in str(e.value)
        assert not dest.parent.exists() or list(dest.parent.iterdir()) == []


def test_fetch_refuses_a_truncated_body_and_a_short_file(server, tmp_path):
    body = TB_FIXTURE.read_bytes()
    entry = tb_entry(body)
    serve(server, entry, body, mode="cut")  # connection closes after half the announced length
    dest = tmp_path / "a" / "data.json"
    with pytest.raises(S.Truncated):
        S.fetch(entry, dest, base_url=server.base, log=lambda m: None)
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    serve(server, entry, body[:1000])  # a complete response holding a shorter file
    with pytest.raises(S.Truncated, match=f"1000 of {len(body)} bytes"):
        S.fetch(entry, dest, base_url=server.base, log=lambda m: None)
    assert not dest.exists()


def test_fetch_refuses_an_invalid_record_and_reports_http_errors(server, tmp_path):
    bad = TB_FIXTURE.read_bytes() + b'{"id": "1", "no_nodes": true}\n'
    entry = tb_entry(bad)
    serve(server, entry, bad)
    dest = tmp_path / "data.json"
    with pytest.raises(S.InvalidRecords, match=f"record {TB_RECORDS}"):
        S.fetch(entry, dest, base_url=server.base, log=lambda m: None)
    assert not dest.exists()
    missing = dataclasses.replace(entry, path="taskbench/nothing.json")
    with pytest.raises(S.HTTPStatus, match="HTTP 404"):
        S.fetch(missing, dest, base_url=server.base, log=lambda m: None)


def test_fetch_from_an_unreachable_host_says_so(tmp_path, monkeypatch):
    entry = tb_entry(TB_FIXTURE.read_bytes())
    with pytest.raises(S.Unreachable, match="cannot connect"):
        S.fetch(entry, tmp_path / "d.json", base_url=f"http://127.0.0.1:{closed_port()}", log=lambda m: None)
    # the way the acceptance run cuts the network: an HTTPS proxy that refuses connections
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(S.Unreachable):
        S.fetch(entry, tmp_path / "d.json", timeout=10, log=lambda m: None)
    assert not (tmp_path / "d.json").exists()


# ------------------------------------------------------------------------------- cache
def test_whole_taskbench_file_downloads_once_then_runs_offline(server, tmp_path, monkeypatch):
    body = TB_FIXTURE.read_bytes()
    entry = tb_entry(body, by="git_blob")
    monkeypatch.setitem(S.TASKBENCH_FULL, "huggingface", entry)
    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(S.ENV_BASE, server.base)
    serve(server, entry, body)
    logs = []
    roots = S.roots_for(["taskbench"], limits={"taskbench": None}, domains=["huggingface"], log=logs.append)
    root = roots["taskbench/huggingface"]
    assert root == tmp_path / "cache" / "benchdata" / "microsoft+JARVIS" / entry.upstream.commit
    assert len(taskbench.load_domain(root, "huggingface")) == TB_RECORDS
    assert taskbench.load_tool_desc(root, "huggingface") == read_json(
        S.package_root() / "taskbench" / "data_huggingface" / "tool_desc.json")
    assert len(server.requests) == 1 and any("downloading it once" in m for m in logs)
    # the cache serves the next run without the network
    monkeypatch.setenv(S.ENV_BASE, f"http://127.0.0.1:{closed_port()}")
    assert S.roots_for(["taskbench"], limits={"taskbench": None}, domains=["huggingface"],
                       log=logs.append)["taskbench/huggingface"] == root
    # a limit within the shipped subset needs no download at all
    assert S.roots_for(["taskbench"], limits={"taskbench": 45}, domains=["huggingface"],
                       log=logs.append)["taskbench/huggingface"] == S.package_root()
    # a damaged cached file is noticed and fetched again
    cached = root / entry.path
    cached.write_bytes(body[:-10])
    monkeypatch.setenv(S.ENV_BASE, server.base)
    S.roots_for(["taskbench"], limits={"taskbench": None}, domains=["huggingface"], log=logs.append)
    assert cached.read_bytes() == body and len(server.requests) == 2
    assert S.origin(cached)["where"].startswith("downloaded")


def test_no_network_error_says_how_to_pass_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(S.ENV_BASE, f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(S.Unreachable) as e:
        S.roots_for(["taskbench"], limits={"taskbench": 46}, domains=["multimedia", "dailylifeapis"],
                    log=lambda m: None)
    msg = str(e.value)
    assert "dailylifeapis" in msg and "--limit 36 or less" in msg and "--data-dir DIR" in msg
    assert "DIR/taskbench/data_<domain>/data.json, tool_desc.json" in msg and "DIR/rotbench/first_turn/" in msg


# ------------------------------------------------------------------------------- origins, CLI
def test_origin_names_shipped_files_and_recognises_upstream_copies(tmp_path):
    shipped = S.origin(S.package_root() / "rotbench" / "first_turn" / "clean.json.gz")
    assert shipped["where"] == "shipped with reflrl" and shipped["repository"] == "Junjie-Ye/RoTBench"
    assert shipped["commit"] == S.ROTBENCH.commit and shipped["license"] == "Apache-2.0"
    assert shipped["upstream_sha256"] == "a367dc165c0bb09f4002c89ab9a6884ef2383547d8e6d21511c7c0153e7ff1cd"
    assert shipped["url"].startswith("https://raw.githubusercontent.com/Junjie-Ye/RoTBench/637e43ae")
    copy = tmp_path / "clean.json"
    copy.write_bytes(gzip.decompress((S.package_root() / "rotbench/first_turn/clean.json.gz").read_bytes()))
    assert S.origin(copy)["matches"]["path"] == "Data/First_Turn/clean.json"
    assert S.origin(FIXTURES / "rotbench" / "first_turn" / "clean.json") == {"where": "--data-dir", "matches": None}


def test_cli_data_download_and_list(server, tmp_path, monkeypatch, capsys):
    from reflrl.cli import main

    body = TB_FIXTURE.read_bytes()
    entry = tb_entry(body, by="git_blob")
    monkeypatch.setitem(S.TASKBENCH_FULL, "huggingface", entry)
    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path / "cache"))
    serve(server, entry, body)
    assert main(["data", "download", "taskbench", "--domains", "huggingface", "--base-url", server.base]) == 0
    assert (S.download_root(entry.upstream) / entry.path).read_bytes() == body
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "taskbench/data_huggingface/data.json (whole)  cached" in out
    assert "rotbench/first_turn/clean.json  shipped" in out
    # --dest: a --data-dir folder of upstream's files; a refused file is one error line, exit 2
    for f in S.SHIPPED:
        if f.benchmark == "rotbench":
            data = gzip.decompress((S.package_root() / f.shipped).read_bytes())
            serve(server, f, data.replace(b"Action", b"Acti0n", 1) if f.layout.endswith("union.json") else data)
    dest = tmp_path / "d"
    assert main(["data", "download", "rotbench", "--dest", str(dest), "--base-url", server.base]) == 2
    assert "sha256" in capsys.readouterr().err
    assert len(rotbench.load_level(dest, "heavy")) == 210
    assert not (dest / "rotbench" / "first_turn" / "union.json").exists()


def test_wheel_carries_the_benchmark_data_without_warnings(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("reflrl-*.whl"))).namelist()
    for f in S.SHIPPED:
        assert f"reflrl/benchdata/{f.shipped}" in names, f.shipped
    for extra in ("ATTRIBUTION.md", "rotbench/LICENSE", "seal-tools/LICENSE", "taskbench/LICENSE"):
        assert f"reflrl/benchdata/{extra}" in names
    log = build.stdout + build.stderr
    assert "benchdata" not in "\n".join(l for l in log.splitlines() if "warning" in l.lower())
