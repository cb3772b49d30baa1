"""Serve the tool server over real HTTP on loopback, with faults acted out on the real socket.

``serve(host, port, ...)`` runs uvicorn (blocking); ``ServerThread`` runs it in a background
thread (tests, benchmarks); ``python -m reflrl.envs.loopback --port P --seed S`` runs it from a shell
(``reflrl tools serve`` calls ``serve``).

uvicorn is given ``NetH11Protocol``: an h11 protocol that hands each request a *net control*
(``scope["extensions"]["reflrl.net"]``) bound to the connection's transport, so the fault injector
can do to the TCP connection what a faulty network or server does:

- ``reset``:  SO_LINGER {on, 0} then ``transport.abort()``: the kernel sends a RST; the client
  reading its response gets ECONNRESET (httpx.ReadError).
- ``stall``:  wait for the given time or until the client hangs up (its read timeout fired:
  httpx.ReadTimeout on the client side), whichever comes first.
- ``close``:  after the injector sent headers with Content-Length N and fewer body bytes, close
  the connection (FIN): the client gets httpx.RemoteProtocolError (incomplete body).

Servers bind 127.0.0.1 by default (project rule).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import threading
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from reflrl.faults.inject import NET_EXTENSION

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class SocketNet:
    """Net control acting on a real asyncio transport (see module docstring)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    async def reset(self, receive) -> None:
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()
        await _wait_disconnect(receive)

    async def stall(self, seconds: float, receive) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await _wait_disconnect(receive)
                return True
        except TimeoutError:
            return False

    async def close(self, receive, sent: int, expected: int) -> None:
        self.transport.close()
        await _wait_disconnect(receive)


class _NetApp:
    """Wraps the ASGI app for one connection: adds the connection's SocketNet to each scope."""

    def __init__(self, app, net: SocketNet) -> None:
        self.app = app
        self.net = net

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            ext = dict(scope.get("extensions") or {})
            ext[NET_EXTENSION] = self.net
            scope["extensions"] = ext
        await self.app(scope, receive, send)


class NetH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a per-connection net control for the fault injector."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # headers and body go out as separate writes: without TCP_NODELAY, Nagle's algorithm
            # plus the client's delayed ACK adds ~40 ms to every response
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.app = _NetApp(self.app, SocketNet(transport))


def make_config(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, http=NetH11Protocol, loop="asyncio",
                          lifespan="on", log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=2, ws="none")


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, seed: int = 0,
          tools: dict | None = None, app=None, sandbox_root: str | None = None,
          log_level: str = "info", announce=print) -> None:
    """Run the tool server on ``host:port`` until interrupted (blocking).

    seed: default data/fault seed of episodes that give none; tools: name -> ToolSpec (default:
    the catalogue); app: serve this ASGI app instead of building one; port 0 picks a free port.
    ``announce`` gets one line with the URL once the socket is bound.
    """
    if app is None:
        from .tool_server import create_app
        app = create_app(tools, sandbox_root=sandbox_root, default_seed=seed)
    sock = _bind(host, port)
    real_port = sock.getsockname()[1]
    n = len(getattr(getattr(app, "server", None), "tools", {}) or {})
    if announce is not None:
        announce(f"reflrl tool server: http://{host}:{real_port} ({n} tools, seed {seed}); "
                 "Ctrl-C stops it")
        sys.stdout.flush()
    server = uvicorn.Server(make_config(app, host, real_port, log_level))
    server.run(sockets=[sock])


class ServerThread:
    """Run an ASGI app under uvicorn (NetH11Protocol) in a background thread.

        with ServerThread(create_app(tools)) as srv:
            client = ToolClient.connect(srv.url)

    port=0 picks a free port (``srv.port`` / ``srv.url`` after start).
    """

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = 0,
                 log_level: str = "warning", *, config=make_config) -> None:
        """``config(app, host, port, log_level) -> uvicorn.Config``: the default serves with the
        fault-capable protocol (real resets and short reads); other apps pass a plain config."""
        self.app = app
        self.host = host
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.server = uvicorn.Server(config(app, host, self.port, log_level))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True, name="reflrl-tool-server")
        self._thread.start()
        ev = threading.Event()
        for _ in range(int(timeout / 0.01)):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            ev.wait(0.01)
        raise RuntimeError(f"tool server did not start on {self.url}")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _port(text: str) -> int:
    """argparse type: a TCP port number, 0..65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reflrl.envs.loopback",
                                 description="Serve the reflrl tool server on loopback HTTP.")
    ap.add_argument("--host", default=DEFAULT_HOST, help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port (0 = any free port)")
    ap.add_argument("--seed", type=int, default=0, help="default seed of episodes that give none")
    ap.add_argument("--sandbox-root", default=None, help="folder for per-episode sandboxes")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    try:
        serve(a.host, a.port, seed=a.seed, sandbox_root=a.sandbox_root, log_level=a.log_level)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
