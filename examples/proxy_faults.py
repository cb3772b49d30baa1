"""Put reflrl's fault proxy in front of an HTTP service and watch a plain client meet its faults.

    python examples/proxy_faults.py --faults rate_limit=0.3,server_error=0.2 --requests 12

A small weather service (Starlette) runs on a free loopback port; the proxy (the same code as
``reflrl faults proxy --upstream URL --faults SPEC``) runs in front of it and injects the plan's
faults, seeded and replayable. The script sends plain ``httpx`` requests through the proxy, prints
what each one got (status, Retry-After, body), then the proxy's ledger of injected faults, which
the proxy also serves at ``GET /_reflrl/ledger``. Run it twice with the same ``--seed``: the same
requests meet the same faults. No model is loaded.

With a service of your own: ``reflrl faults proxy --upstream http://127.0.0.1:9000 --faults ...`` and
point your client (or reflrl's environments, via ``reflrl.envs.http_tools``) at the proxy's port.
"""
from __future__ import annotations

import argparse

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reflrl.envs.loopback import ServerThread
from reflrl.envs.proxy import FaultProxy


async def weather(request: Request) -> JSONResponse:
    city = request.query_params.get("city", "Paris")
    return JSONResponse({"city": city, "temp_c": 12.5, "condition": "cloudy"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--faults", default="rate_limit=0.3,server_error=0.2",
                    help="fault spec kind=prob[:param],... (see 'reflrl faults list')")
    ap.add_argument("--seed", type=int, default=0, help="fault seed: the same seed replays the same faults")
    ap.add_argument("--requests", type=int, default=12, help="requests to send through the proxy")
    args = ap.parse_args(argv)

    service = Starlette(routes=[Route("/weather", weather)])
    with ServerThread(service) as upstream:
        proxy = FaultProxy(upstream.url, args.faults, seed=args.seed)
        with ServerThread(proxy) as front, httpx.Client(base_url=front.url, timeout=5.0) as client:
            print(f"service {upstream.url}, proxy {front.url}, faults {args.faults}, seed {args.seed}")
            for i in range(args.requests):
                city = ("Paris", "Oslo", "Lima")[i % 3]
                try:
                    r = client.get("/weather", params={"city": city})
                    extra = f" retry-after={r.headers['retry-after']}" if "retry-after" in r.headers else ""
                    print(f"{i:3d} GET /weather?city={city}: {r.status_code}{extra} {r.text[:70]}")
                except httpx.TransportError as e:  # timeouts, resets, cut bodies: what a real client sees
                    print(f"{i:3d} GET /weather?city={city}: {type(e).__name__}")
            ledger = client.get("/_reflrl/ledger").json()
        print(f"ledger: {len(ledger.get('events', []))} injected fault(s)")
        print(proxy.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
