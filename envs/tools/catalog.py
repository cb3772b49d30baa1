"""The synthetic tool catalogue: 32 faker-built tools in 7 domains.

Every tool is a :class:`~reflrl.envs.tools.base.ToolSpec` with an OpenAI/BFCL style JSON schema
(types, enums, required and optional fields whose defaults are stated) and a ``returns`` schema.

Determinism: a handler's answer is a pure function of ``(ctx.seed, tool name, arguments)`` (plus,
for the stateful file and calendar tools, what earlier calls of the same episode did). Each call
re-seeds a faker instance (``seeded_faker``) or makes a ``random.Random`` (``seeded_rng``)
from a blake2b hash of those three; faker instances are private to the calling thread and
re-seeded at the start of every call, so concurrent episodes never share random state.

Policy errors (an unknown city or ticker, a date in the wrong format, a file that does not exist,
...) raise :class:`ToolError`; the server answers them as a 4xx the client triages as
``policy_error``. File tools resolve EVERY path through ``ctx.resolve_in_sandbox``; each episode's
sandbox is filled lazily, on the first file call, with a few files whose content depends on
``ctx.seed`` (their names are fixed, see ``SANDBOX_FILES``, so generated tasks can name them).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import random
import re
import threading
from typing import Any, Callable

from faker import Faker

from .base import ToolContext, ToolError, ToolSpec

DOMAINS: tuple[str, ...] = (
    "weather", "finance", "travel", "files", "messaging", "calendar", "ecommerce",
)

# ---------------------------------------------------------------------------------------------
# Static reference data (what makes "unknown city/ticker/code" a checkable policy error).
# ---------------------------------------------------------------------------------------------

#: city name -> (country, IATA code of its main airport, airport name)
CITIES: dict[str, tuple[str, str, str]] = {
    "Paris": ("France", "CDG", "Charles de Gaulle"),
    "London": ("United Kingdom", "LHR", "Heathrow"),
    "Berlin": ("Germany", "BER", "Brandenburg"),
    "Madrid": ("Spain", "MAD", "Barajas"),
    "Rome": ("Italy", "FCO", "Fiumicino"),
    "Amsterdam": ("Netherlands", "AMS", "Schiphol"),
    "Lisbon": ("Portugal", "LIS", "Humberto Delgado"),
    "Vienna": ("Austria", "VIE", "Vienna International"),
    "Zurich": ("Switzerland", "ZRH", "Zurich"),
    "Dublin": ("Ireland", "DUB", "Dublin"),
    "Oslo": ("Norway", "OSL", "Gardermoen"),
    "Stockholm": ("Sweden", "ARN", "Arlanda"),
    "Warsaw": ("Poland", "WAW", "Chopin"),
    "Athens": ("Greece", "ATH", "Eleftherios Venizelos"),
    "Istanbul": ("Turkey", "IST", "Istanbul"),
    "Cairo": ("Egypt", "CAI", "Cairo International"),
    "Dubai": ("United Arab Emirates", "DXB", "Dubai International"),
    "Mumbai": ("India", "BOM", "Chhatrapati Shivaji"),
    "Delhi": ("India", "DEL", "Indira Gandhi"),
    "Singapore": ("Singapore", "SIN", "Changi"),
    "Bangkok": ("Thailand", "BKK", "Suvarnabhumi"),
    "Tokyo": ("Japan", "HND", "Haneda"),
    "Seoul": ("South Korea", "ICN", "Incheon"),
    "Beijing": ("China", "PEK", "Capital"),
    "Sydney": ("Australia", "SYD", "Kingsford Smith"),
    "Toronto": ("Canada", "YYZ", "Pearson"),
    "Chicago": ("United States", "ORD", "O'Hare"),
    "Boston": ("United States", "BOS", "Logan"),
    "Miami": ("United States", "MIA", "Miami International"),
    "Denver": ("United States", "DEN", "Denver International"),
    "Seattle": ("United States", "SEA", "Seattle-Tacoma"),
    "Mexico City": ("Mexico", "MEX", "Benito Juarez"),
    "Lima": ("Peru", "LIM", "Jorge Chavez"),
    "Nairobi": ("Kenya", "NBO", "Jomo Kenyatta"),
}
AIRPORTS: dict[str, str] = {code: city for city, (_, code, _) in CITIES.items()}
_CITY_BY_LOWER = {c.lower(): c for c in CITIES}

#: ticker -> company name
TICKERS: dict[str, str] = {
    "AAPL": "Apple", "MSFT": "Microsoft", "GOOGL": "Alphabet", "AMZN": "Amazon",
    "NVDA": "Nvidia", "META": "Meta", "TSLA": "Tesla", "NFLX": "Netflix", "INTC": "Intel",
    "AMD": "AMD", "IBM": "IBM", "ORCL": "Oracle", "KO": "Coca-Cola", "PEP": "PepsiCo",
    "DIS": "Disney", "NKE": "Nike", "JPM": "JPMorgan", "V": "Visa", "WMT": "Walmart",
    "XOM": "Exxon", "BA": "Boeing", "SBUX": "Starbucks", "UBER": "Uber", "SHOP": "Shopify",
}
CURRENCIES: tuple[str, ...] = (
    "USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "SEK", "NOK", "MXN",
)
_USD_PER_UNIT = {  # rough anchors; a seeded wobble is added per episode
    "USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067, "CHF": 1.12, "CAD": 0.74,
    "AUD": 0.66, "CNY": 0.14, "INR": 0.012, "SEK": 0.095, "NOK": 0.094, "MXN": 0.058,
}
CRYPTOS: tuple[str, ...] = ("BTC", "ETH", "SOL", "ADA", "DOGE", "XRP")
AIRLINES: dict[str, str] = {
    "AF": "Air France", "BA": "British Airways", "LH": "Lufthansa", "IB": "Iberia",
    "KL": "KLM", "EK": "Emirates", "SQ": "Singapore Airlines", "NH": "ANA",
    "UA": "United", "DL": "Delta", "AA": "American", "AC": "Air Canada",
}

UNITS = ("celsius", "fahrenheit")
PERIODS = ("day", "week", "month", "year")
CABINS = ("economy", "premium", "business", "first")
SORTS = ("relevance", "price", "rating", "newest")
FOLDERS = ("inbox", "sent", "archive")

#: the files every episode sandbox starts with (content varies with ctx.seed)
SANDBOX_FILES: tuple[str, ...] = (
    "notes.txt", "todo.md", "config.json", "reports/q1.csv", "reports/q2.csv", "logs/app.log",
)

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")
_EMAIL_RE = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$")
_PHONE_RE = re.compile(r"^\+?[0-9][0-9 ()-]{6,18}[0-9]$")
_FLIGHT_RE = re.compile(r"^([A-Z]{2})(\d{1,4})$")
_EVENT_RE = re.compile(r"^EVT-\d{4}$")
_PRODUCT_RE = re.compile(r"^P-\d{5}$")
_ORDER_RE = re.compile(r"^ORD-\d{6}$")
_TRACKING_RE = re.compile(r"^TRK\d{10}$")
MAX_FILE_CHARS = 20_000


# ---------------------------------------------------------------------------------------------
# Determinism helpers
# ---------------------------------------------------------------------------------------------

_local = threading.local()


def call_seed(seed: int, tool: str, arguments: dict[str, Any]) -> int:
    """A 64-bit seed from blake2b over (episode seed, tool name, canonical JSON of arguments)."""
    payload = json.dumps([int(seed), tool, arguments], sort_keys=True, separators=(",", ":"),
                         default=str)
    return int.from_bytes(hashlib.blake2b(payload.encode(), digest_size=8).digest(), "big")


def seeded_faker(seed: int, tool: str, arguments: dict[str, Any], slot: str = "main") -> Faker:
    """This thread's own Faker for ``slot``, re-seeded for this call (never shared between
    threads). Handlers use slot "main"; the shared helpers they call (products, seeded events,
    sandbox files) use "aux", so a helper never re-seeds the instance its caller is using."""
    fakes = _local.__dict__.setdefault("fakes", {})
    fake = fakes.get(slot)
    if fake is None:
        fake = fakes[slot] = Faker("en_US")
    fake.seed_instance(call_seed(seed, tool, arguments))
    return fake


def seeded_rng(seed: int, tool: str, arguments: dict[str, Any]) -> random.Random:
    """An independent random.Random seeded like ``seeded_faker`` (for plain numbers)."""
    return random.Random(call_seed(seed, tool, arguments))


def _rng(fake: Faker):
    """The random.Random behind a seeded Faker instance (for plain numbers)."""
    return fake.random


# ---------------------------------------------------------------------------------------------
# Validation helpers (raise ToolError: the caller's fault)
# ---------------------------------------------------------------------------------------------

def _city(value: str) -> str:
    name = _CITY_BY_LOWER.get(str(value).strip().lower())
    if name is None:
        raise ToolError(f"unknown city {value!r}", kind="unknown_city")
    return name


def _airport(code: str) -> str:
    c = str(code).strip()
    if c not in AIRPORTS:
        raise ToolError(f"unknown airport code {code!r} (expected an IATA code like 'LHR')",
                        kind="unknown_airport")
    return c


def _ticker(symbol: str) -> str:
    s = str(symbol).strip()
    if s not in TICKERS:
        raise ToolError(f"unknown ticker symbol {symbol!r}", kind="unknown_symbol")
    return s


def _date(value: str, field: str = "date") -> _dt.date:
    if not isinstance(value, str) or not _DATE_RE.match(value):
        raise ToolError(f"{field} {value!r} is not in YYYY-MM-DD format", kind="invalid_date")
    try:
        return _dt.date.fromisoformat(value)
    except ValueError:
        raise ToolError(f"{field} {value!r} is not a real calendar date", kind="invalid_date")


def _pattern(value: str, rx: re.Pattern, what: str, example: str) -> str:
    if not isinstance(value, str) or not rx.match(value):
        raise ToolError(f"{what} {value!r} is malformed (expected like {example!r})",
                        kind=f"invalid_{what.replace(' ', '_')}")
    return value


def _range(value: Any, lo: float, hi: float, field: str) -> Any:
    if not (lo <= value <= hi):
        raise ToolError(f"{field}={value} is out of range [{lo}, {hi}]", kind="out_of_range")
    return value


# ---------------------------------------------------------------------------------------------
# Schema helpers
# ---------------------------------------------------------------------------------------------

def _params(props: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _s(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _i(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **kw}


def _n(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **kw}


def _obj(**props: Any) -> dict[str, Any]:
    """A compact returns schema: field -> JSON type name or a full schema."""
    out = {}
    for k, v in props.items():
        out[k] = {"type": v} if isinstance(v, str) else v
    return {"type": "object", "properties": out, "required": list(out)}


def _arr(item: dict[str, Any] | str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": item} if isinstance(item, str) else item}


# ---------------------------------------------------------------------------------------------
# Weather
# ---------------------------------------------------------------------------------------------

def _temp(fake: Faker, units: str, lo: float = -10, hi: float = 35) -> float:
    c = round(_rng(fake).uniform(lo, hi), 1)
    return c if units == "celsius" else round(c * 9 / 5 + 32, 1)


_CONDITIONS = ("sunny", "cloudy", "rain", "snow", "fog", "windy", "storm", "partly cloudy")


def get_current_weather(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    city = _city(args["city"])
    units = args.get("units", "celsius")
    fake = seeded_faker(ctx.seed, "get_current_weather", {"city": city})
    r = _rng(fake)
    return {"city": city, "temperature": _temp(fake, units), "units": units,
            "condition": r.choice(_CONDITIONS), "humidity": r.randint(15, 100),
            "wind_kph": round(r.uniform(0, 60), 1)}


def get_forecast(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    city = _city(args["city"])
    days = _range(args.get("days", 3), 1, 7, "days")
    units = args.get("units", "celsius")
    fake = seeded_faker(ctx.seed, "get_forecast", {"city": city})
    r = _rng(fake)
    start = _dt.date(2026, 1, 1) + _dt.timedelta(days=r.randint(0, 364))
    out = []
    for d in range(days):
        lo = _temp(fake, units, -15, 20)
        out.append({"date": (start + _dt.timedelta(days=d)).isoformat(), "low": lo,
                    "high": round(lo + r.uniform(2, 12), 1), "condition": r.choice(_CONDITIONS),
                    "rain_chance": r.randint(0, 100)})
    return {"city": city, "units": units, "days": out}


def get_air_quality(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    city = _city(args["city"])
    r = seeded_rng(ctx.seed, "get_air_quality", {"city": city})
    aqi = r.randint(5, 300)
    level = ("good" if aqi <= 50 else "moderate" if aqi <= 100 else "unhealthy" if aqi <= 200
             else "very unhealthy")
    return {"city": city, "aqi": aqi, "level": level, "pm25": round(aqi * 0.42, 1)}


def get_weather_alerts(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    city = _city(args["city"])
    fake = seeded_faker(ctx.seed, "get_weather_alerts", {"city": city})
    r = _rng(fake)
    kinds = ("heat", "flood", "wind", "snow", "thunderstorm", "frost")
    alerts = [{"type": r.choice(kinds), "severity": r.choice(("minor", "moderate", "severe")),
               "until": fake.date_between_dates(_dt.date(2026, 1, 1),
                                                _dt.date(2026, 12, 31)).isoformat()}
              for _ in range(r.randint(0, 2))]
    return {"city": city, "alerts": alerts}


# ---------------------------------------------------------------------------------------------
# Finance
# ---------------------------------------------------------------------------------------------

def _base_price(seed: int, symbol: str) -> float:
    r = seeded_rng(seed, "_price", {"symbol": symbol})
    return round(r.uniform(12, 900), 2)


def get_stock_quote(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    sym = _ticker(args["symbol"])
    price = _base_price(ctx.seed, sym)
    r = seeded_rng(ctx.seed, "get_stock_quote", {"symbol": sym})
    change = round(r.uniform(-5, 5), 2)
    return {"symbol": sym, "company": TICKERS[sym], "price": price, "change_pct": change,
            "volume": r.randint(100_000, 90_000_000), "currency": "USD"}


def get_market_trend(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    sym = _ticker(args["symbol"])
    period = args.get("period", "month")
    price = _base_price(ctx.seed, sym)
    r = seeded_rng(ctx.seed, "get_market_trend", {"symbol": sym, "period": period})
    n = {"day": 8, "week": 7, "month": 10, "year": 12}[period]
    series, p = [], price
    for _ in range(n):
        p = round(max(1.0, p * (1 + r.uniform(-0.04, 0.04))), 2)
        series.append(p)
    series[-1] = price
    first = series[0]
    pct = round((price - first) / first * 100, 2)
    return {"symbol": sym, "period": period, "prices": series, "change_pct": pct,
            "trend": "up" if pct > 1 else "down" if pct < -1 else "flat"}


def _rate(seed: int, base: str, target: str) -> float:
    def usd(c: str) -> float:
        r = seeded_rng(seed, "_fx", {"c": c})
        return _USD_PER_UNIT[c] * (1 + r.uniform(-0.03, 0.03)) if c != "USD" else 1.0
    return round(usd(base) / usd(target), 6)


def get_exchange_rate(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    base, target = args["base"], args["target"]
    return {"base": base, "target": target, "rate": _rate(ctx.seed, base, target)}


def convert_currency(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    amount = args["amount"]
    if amount <= 0:
        raise ToolError(f"amount must be positive, got {amount}", kind="out_of_range")
    rate = _rate(ctx.seed, args["from_currency"], args["to_currency"])
    return {"amount": amount, "from_currency": args["from_currency"],
            "to_currency": args["to_currency"], "rate": rate,
            "converted": round(amount * rate, 2)}


def get_crypto_price(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    coin, cur = args["coin"], args.get("currency", "USD")
    r = seeded_rng(ctx.seed, "get_crypto_price", {"coin": coin})
    usd = {"BTC": 60_000, "ETH": 3_000, "SOL": 150, "ADA": 0.5, "DOGE": 0.15, "XRP": 0.6}[coin]
    usd *= 1 + r.uniform(-0.1, 0.1)
    return {"coin": coin, "currency": cur, "price": round(usd / _rate(ctx.seed, cur, "USD"), 4),
            "change_24h_pct": round(r.uniform(-8, 8), 2)}


# ---------------------------------------------------------------------------------------------
# Travel
# ---------------------------------------------------------------------------------------------

def search_flights(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    origin, dest = _airport(args["origin"]), _airport(args["destination"])
    if origin == dest:
        raise ToolError("origin and destination are the same airport", kind="invalid_value")
    day = _date(args["date"])
    cabin = args.get("cabin", "economy")
    r = seeded_rng(ctx.seed, "search_flights", args)
    mult = {"economy": 1, "premium": 1.7, "business": 3.5, "first": 6}[cabin]
    flights = []
    for _ in range(r.randint(1, 4)):
        code = r.choice(sorted(AIRLINES))
        dep = r.randint(5, 22)
        flights.append({"flight_number": f"{code}{r.randint(10, 9999)}",
                        "airline": AIRLINES[code],
                        "departure": f"{day}T{dep:02d}:{r.choice((0, 15, 30, 45)):02d}",
                        "duration_min": r.randint(55, 900),
                        "price": round(r.uniform(60, 900) * mult, 2), "stops": r.randint(0, 2)})
    return {"origin": origin, "destination": dest, "date": day.isoformat(), "cabin": cabin,
            "flights": flights}


def search_hotels(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    city = _city(args["city"])
    _date(args["check_in"], "check_in")
    nights = _range(args.get("nights", 1), 1, 30, "nights")
    guests = _range(args.get("guests", 1), 1, 8, "guests")
    fake = seeded_faker(ctx.seed, "search_hotels", args)
    r = _rng(fake)
    hotels = [{"name": f"{fake.last_name()} {r.choice(('Hotel', 'Inn', 'Suites', 'Lodge'))}",
               "stars": r.randint(2, 5), "price_per_night": round(r.uniform(50, 450), 2),
               "rating": round(r.uniform(6, 9.8), 1)} for _ in range(r.randint(1, 4))]
    return {"city": city, "check_in": args["check_in"], "nights": nights, "guests": guests,
            "hotels": hotels}


def get_flight_status(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    fn = _pattern(args["flight_number"], _FLIGHT_RE, "flight number", "AF1234")
    airline = _FLIGHT_RE.match(fn).group(1)
    if airline not in AIRLINES:
        raise ToolError(f"unknown airline code {airline!r} in flight {fn!r}", kind="unknown_flight")
    r = seeded_rng(ctx.seed, "get_flight_status", {"flight_number": fn})
    status = r.choice(("scheduled", "on time", "delayed", "boarding", "landed", "cancelled"))
    codes = sorted(AIRPORTS)
    a = r.choice(codes)
    b = r.choice([c for c in codes if c != a])
    return {"flight_number": fn, "airline": AIRLINES[airline], "status": status,
            "origin": a, "destination": b,
            "delay_min": r.randint(10, 180) if status == "delayed" else 0,
            "gate": f"{r.choice('ABCDEF')}{r.randint(1, 40)}"}


def get_airport_info(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    code = _airport(args["code"])
    city = AIRPORTS[code]
    country, _, name = CITIES[city]
    r = seeded_rng(ctx.seed, "get_airport_info", {"code": code})
    return {"code": code, "name": name, "city": city, "country": country,
            "terminals": r.randint(1, 5), "avg_security_wait_min": r.randint(5, 60)}


# ---------------------------------------------------------------------------------------------
# Files (sandboxed)
# ---------------------------------------------------------------------------------------------

def _ensure_sandbox(ctx: ToolContext) -> None:
    """Create the episode's starting files on the first file call (content from ctx.seed)."""
    st = ctx.state.setdefault("catalog", {})
    if st.get("files_ready"):
        return
    fake = seeded_faker(ctx.seed, "_sandbox", {}, slot="aux")
    r = _rng(fake)
    contents = {
        "notes.txt": "\n".join(fake.sentence() for _ in range(4)) + "\n",
        "todo.md": "".join(f"- [ ] {fake.bs()}\n" for _ in range(3)),
        "config.json": json.dumps({"name": fake.slug(), "version": f"1.{r.randint(0, 9)}",
                                   "debug": r.random() < 0.5}, indent=2) + "\n",
        "reports/q1.csv": "month,revenue\n" + "".join(
            f"{m},{r.randint(1000, 9000)}\n" for m in ("jan", "feb", "mar")),
        "reports/q2.csv": "month,revenue\n" + "".join(
            f"{m},{r.randint(1000, 9000)}\n" for m in ("apr", "may", "jun")),
        "logs/app.log": "".join(
            f"2026-01-0{i + 1} {r.choice(('INFO', 'WARN', 'ERROR'))} {fake.sentence(nb_words=5)}\n"
            for i in range(5)),
    }
    for rel in SANDBOX_FILES:
        p = ctx.resolve_in_sandbox(rel)
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(contents[rel], encoding="utf-8")
    st["files_ready"] = True


def _inside(ctx: ToolContext, path: str):
    """A model-given path resolved by ``ctx.resolve_in_sandbox``, after rejecting values the
    OS would choke on (NUL bytes, absurd lengths) with a ToolError instead of a crash."""
    if not isinstance(path, str) or "\x00" in path or len(path) > 512:
        raise ToolError(f"invalid path {str(path)[:80]!r}", kind="invalid_path")
    try:
        return ctx.resolve_in_sandbox(path)
    except (OSError, ValueError) as e:
        raise ToolError(f"invalid path {path[:80]!r}: {e}", kind="invalid_path") from None


def _io(fn):
    """Turn an OS error from a file tool (name too long, permission, ...) into a ToolError."""
    def wrapped(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        try:
            return fn(args, ctx)
        except OSError as e:
            raise ToolError(f"{fn.__name__}: {e.strerror or e}", kind="io_error") from None
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def _rel(ctx: ToolContext, p) -> str:
    return p.relative_to(ctx.sandbox.resolve()).as_posix() or "."


def _existing_file(ctx: ToolContext, path: str):
    p = _inside(ctx, path)
    if not p.exists():
        raise ToolError(f"file {path!r} does not exist", kind="file_not_found")
    if not p.is_file():
        raise ToolError(f"{path!r} is a directory, not a file", kind="not_a_file")
    return p


@_io
def list_files(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    directory = args.get("directory", ".")
    d = _inside(ctx, directory)
    if not d.exists():
        raise ToolError(f"directory {directory!r} does not exist", kind="file_not_found")
    if not d.is_dir():
        raise ToolError(f"{directory!r} is a file, not a directory", kind="not_a_directory")
    entries = []
    for child in sorted(d.iterdir()):
        entries.append({"name": child.name, "type": "dir" if child.is_dir() else "file",
                        "size": child.stat().st_size if child.is_file() else 0})
    return {"directory": _rel(ctx, d), "entries": entries}


@_io
def read_file(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    p = _existing_file(ctx, args["path"])
    text = p.read_text(encoding="utf-8", errors="replace")
    return {"path": _rel(ctx, p), "content": text[:MAX_FILE_CHARS],
            "truncated": len(text) > MAX_FILE_CHARS}


@_io
def write_file(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    content = args["content"]
    if len(content) > MAX_FILE_CHARS:
        raise ToolError(f"content is {len(content)} chars, the limit is {MAX_FILE_CHARS}",
                        kind="too_large")
    p = _inside(ctx, args["path"])
    if p == ctx.sandbox.resolve() or p.is_dir():
        raise ToolError(f"{args['path']!r} is a directory", kind="not_a_file")
    if p.exists() and not args.get("overwrite", False):
        raise ToolError(f"file {args['path']!r} exists (pass overwrite=true)", kind="file_exists")
    data = content.encode("utf-8")
    ctx.check_quota(p, len(data))  # the episode's disk quota (ToolError quota_exceeded)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return {"path": _rel(ctx, p), "bytes_written": len(data)}


@_io
def delete_file(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    p = _existing_file(ctx, args["path"])
    p.unlink()
    return {"path": _rel(ctx, p), "deleted": True}


@_io
def search_files(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    needle = args["pattern"]
    if not needle:
        raise ToolError("pattern must not be empty", kind="invalid_value")
    directory = args.get("directory", ".")
    d = _inside(ctx, directory)
    if not d.is_dir():
        raise ToolError(f"directory {directory!r} does not exist", kind="file_not_found")
    matches = []
    for p in sorted(d.rglob("*")):
        if not p.is_file():
            continue
        try:
            p = ctx.resolve_in_sandbox(_rel(ctx, p))  # symlinks must not lead out either
        except ToolError:
            continue
        for no, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if needle.lower() in line.lower():
                matches.append({"path": _rel(ctx, p), "line": no, "text": line[:200]})
                if len(matches) >= 50:
                    return {"pattern": needle, "matches": matches}
    return {"pattern": needle, "matches": matches}


@_io
def get_file_info(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    _ensure_sandbox(ctx)
    p = _inside(ctx, args["path"])
    if not p.exists():
        raise ToolError(f"{args['path']!r} does not exist", kind="file_not_found")
    text = p.read_text(encoding="utf-8", errors="replace") if p.is_file() else ""
    return {"path": _rel(ctx, p), "type": "dir" if p.is_dir() else "file",
            "size": p.stat().st_size if p.is_file() else 0,
            "lines": len(text.splitlines())}


# ---------------------------------------------------------------------------------------------
# Messaging
# ---------------------------------------------------------------------------------------------

def send_email(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    to = _pattern(args["to"], _EMAIL_RE, "email", "ana@example.com")
    if not args["subject"].strip():
        raise ToolError("subject must not be empty", kind="invalid_value")
    r = seeded_rng(ctx.seed, "send_email", args)
    mid = f"MSG-{r.randint(100000, 999999)}"
    ctx.state.setdefault("catalog", {}).setdefault("sent", []).append(
        {"id": mid, "to": to, "subject": args["subject"]})
    return {"message_id": mid, "to": to, "status": "sent"}


def send_sms(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    phone = _pattern(args["phone"], _PHONE_RE, "phone number", "+1 555 0100")
    msg = args["message"]
    if not msg.strip():
        raise ToolError("message must not be empty", kind="invalid_value")
    r = seeded_rng(ctx.seed, "send_sms", args)
    return {"sms_id": f"SMS-{r.randint(100000, 999999)}", "phone": phone,
            "segments": max(1, -(-len(msg) // 160)), "status": "queued"}


def list_messages(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    folder = args.get("folder", "inbox")
    limit = _range(args.get("limit", 5), 1, 20, "limit")
    fake = seeded_faker(ctx.seed, "list_messages", {"folder": folder})
    r = _rng(fake)
    msgs = [{"id": f"MSG-{r.randint(100000, 999999)}", "from": fake.email(),
             "subject": fake.sentence(nb_words=4).rstrip("."), "unread": r.random() < 0.4}
            for _ in range(limit)]
    if folder == "sent":
        sent = ctx.state.get("catalog", {}).get("sent", [])
        msgs = [{"id": m["id"], "from": "me", "subject": m["subject"], "unread": False}
                for m in reversed(sent)][:limit] + msgs
        msgs = msgs[:limit]
    return {"folder": folder, "messages": msgs}


def search_contacts(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    name = args["name"].strip()
    if len(name) < 2:
        raise ToolError("name must have at least 2 characters", kind="invalid_value")
    fake = seeded_faker(ctx.seed, "search_contacts", {"name": name.lower()})
    r = _rng(fake)
    parts = name.split()
    out = []
    for _ in range(r.randint(0, 3)):
        first = parts[0].title() if parts else fake.first_name()
        last = parts[1].title() if len(parts) > 1 else fake.last_name()
        out.append({"name": f"{first} {last}",
                    "email": f"{first}.{last}@{fake.free_email_domain()}".lower(),
                    "phone": fake.numerify("+1 555 ####")})
    return {"query": name, "contacts": out}


# ---------------------------------------------------------------------------------------------
# Calendar (stateful per episode: created and cancelled events)
# ---------------------------------------------------------------------------------------------

def _cal(ctx: ToolContext) -> dict[str, Any]:
    return ctx.state.setdefault("catalog", {}).setdefault(
        "calendar", {"created": {}, "cancelled": []})


def _seeded_events(ctx: ToolContext, day: _dt.date) -> list[dict[str, Any]]:
    fake = seeded_faker(ctx.seed, "_events", {"date": day.isoformat()}, slot="aux")
    r = _rng(fake)
    out = []
    for _ in range(r.randint(0, 3)):
        h = r.randint(8, 17)
        out.append({"event_id": f"EVT-{r.randint(1000, 9999)}",
                    "title": fake.catch_phrase(), "date": day.isoformat(),
                    "start_time": f"{h:02d}:{r.choice((0, 30)):02d}",
                    "duration_minutes": r.choice((30, 60, 90))})
    return out


def create_event(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    day = _date(args["date"])
    start = _pattern(args["start_time"], _TIME_RE, "time", "14:30")
    duration = _range(args.get("duration_minutes", 60), 5, 24 * 60, "duration_minutes")
    cal = _cal(ctx)
    r = seeded_rng(ctx.seed, "create_event", args)
    eid = f"EVT-{r.randint(1000, 9999)}"
    while eid in cal["created"]:
        eid = f"EVT-{r.randint(1000, 9999)}"
    ev = {"event_id": eid, "title": args["title"], "date": day.isoformat(), "start_time": start,
          "duration_minutes": duration}
    cal["created"][eid] = ev
    return {**ev, "status": "created"}


def list_events(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    day = _date(args["date"])
    cal = _cal(ctx)
    events = [e for e in _seeded_events(ctx, day) if e["event_id"] not in cal["cancelled"]]
    events += [e for e in cal["created"].values()
               if e["date"] == day.isoformat() and e["event_id"] not in cal["cancelled"]]
    events.sort(key=lambda e: e["start_time"])
    return {"date": day.isoformat(), "events": events}


def cancel_event(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    eid = _pattern(args["event_id"], _EVENT_RE, "event id", "EVT-1234")
    cal = _cal(ctx)
    if eid in cal["cancelled"]:
        raise ToolError(f"event {eid} is already cancelled", kind="already_cancelled")
    cal["cancelled"].append(eid)
    return {"event_id": eid, "status": "cancelled"}


def find_free_slot(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    day = _date(args["date"])
    duration = _range(args["duration_minutes"], 5, 8 * 60, "duration_minutes")
    busy = []
    for e in list_events({"date": day.isoformat()}, ctx)["events"]:
        h, m = map(int, e["start_time"].split(":"))
        busy.append((h * 60 + m, h * 60 + m + e["duration_minutes"]))
    t = 9 * 60
    for s, e in sorted(busy) + [(18 * 60, 18 * 60)]:
        if s - t >= duration:
            return {"date": day.isoformat(), "start_time": f"{t // 60:02d}:{t % 60:02d}",
                    "duration_minutes": duration, "found": True}
        t = max(t, e)
    return {"date": day.isoformat(), "start_time": "", "duration_minutes": duration,
            "found": False}


# ---------------------------------------------------------------------------------------------
# E-commerce
# ---------------------------------------------------------------------------------------------

def _product(seed: int, pid: str) -> dict[str, Any]:
    fake = seeded_faker(seed, "_product", {"id": pid}, slot="aux")
    r = _rng(fake)
    kind = r.choice(("Lamp", "Backpack", "Mug", "Headphones", "Chair", "Jacket", "Kettle", "Watch"))
    return {"product_id": pid, "name": f"{fake.color_name()} {kind}",
            "price": round(r.uniform(5, 400), 2), "rating": round(r.uniform(2.5, 5), 1),
            "in_stock": r.random() < 0.85}


def search_products(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    q = args["query"].strip()
    if not q:
        raise ToolError("query must not be empty", kind="invalid_value")
    sort_by = args.get("sort_by", "relevance")
    limit = _range(args.get("limit", 5), 1, 20, "limit")
    r = seeded_rng(ctx.seed, "search_products", {"query": q.lower()})
    items = [_product(ctx.seed, f"P-{r.randint(10000, 99999)}") for _ in range(12)]
    for it in items:
        it["name"] = f"{it['name'].split()[0]} {q}"
    if "max_price" in args:
        if args["max_price"] <= 0:
            raise ToolError("max_price must be positive", kind="out_of_range")
        items = [it for it in items if it["price"] <= args["max_price"]]
    if sort_by == "price":
        items.sort(key=lambda it: it["price"])
    elif sort_by == "rating":
        items.sort(key=lambda it: -it["rating"])
    elif sort_by == "newest":
        items.reverse()
    return {"query": q, "sort_by": sort_by, "results": items[:limit]}


def get_product_details(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    pid = _pattern(args["product_id"], _PRODUCT_RE, "product id", "P-12345")
    fake = seeded_faker(ctx.seed, "get_product_details", {"product_id": pid})
    return {**_product(ctx.seed, pid), "description": fake.sentence(nb_words=10),
            "seller": fake.company()}


def add_to_cart(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    pid = _pattern(args["product_id"], _PRODUCT_RE, "product id", "P-12345")
    qty = _range(args.get("quantity", 1), 1, 10, "quantity")
    prod = _product(ctx.seed, pid)
    if not prod["in_stock"]:
        raise ToolError(f"product {pid} is out of stock", kind="out_of_stock")
    cart = ctx.state.setdefault("catalog", {}).setdefault("cart", {})
    cart[pid] = cart.get(pid, 0) + qty
    total = sum(_product(ctx.seed, p)["price"] * q for p, q in cart.items())
    return {"product_id": pid, "quantity": cart[pid], "cart_items": sum(cart.values()),
            "cart_total": round(total, 2)}


def get_order_status(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    oid = _pattern(args["order_id"], _ORDER_RE, "order id", "ORD-123456")
    r = seeded_rng(ctx.seed, "get_order_status", {"order_id": oid})
    status = r.choice(("processing", "shipped", "delivered", "cancelled"))
    return {"order_id": oid, "status": status, "items": r.randint(1, 5),
            "total": round(r.uniform(10, 600), 2),
            "tracking_number": f"TRK{r.randint(10**9, 10**10 - 1)}"
            if status in ("shipped", "delivered") else ""}


def track_package(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    tn = _pattern(args["tracking_number"], _TRACKING_RE, "tracking number", "TRK0123456789")
    fake = seeded_faker(ctx.seed, "track_package", {"tracking_number": tn})
    r = _rng(fake)
    steps = ("label created", "picked up", "in transit", "out for delivery", "delivered")
    k = r.randint(1, len(steps))
    return {"tracking_number": tn, "status": steps[k - 1],
            "carrier": r.choice(("UPS", "DHL", "FedEx")),
            "history": [{"event": s, "location": r.choice(sorted(CITIES))} for s in steps[:k]]}


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------

_CITY = _s("City name, e.g. 'Paris'.")
_UNITS = _s("Temperature units (default celsius).", enum=list(UNITS), default="celsius")
_DATE = _s("Date as YYYY-MM-DD.")
_CUR = _s("ISO currency code.", enum=list(CURRENCIES))
_DAY_FORECAST = _obj(date="string", low="number", high="number", condition="string",
                     rain_chance="integer")
_FLIGHT = _obj(flight_number="string", airline="string", departure="string",
               duration_min="integer", price="number", stops="integer")
_ENTRY = _obj(name="string", type="string", size="integer")
_EVENT = _obj(event_id="string", title="string", date="string", start_time="string",
              duration_minutes="integer")
_PRODUCT = _obj(product_id="string", name="string", price="number", rating="number",
                in_stock="boolean")


def _spec(name: str, domain: str, desc: str, handler: Callable, props: dict, required: list,
          returns: dict) -> ToolSpec:
    return ToolSpec(name=name, domain=domain, description=desc,
                    parameters=_params(props, required), handler=handler, returns=returns)


def build_catalog() -> dict[str, ToolSpec]:
    """All catalogue tools by name (32 tools, 7 domains; see ``DOMAINS``)."""
    specs = [
        # weather
        _spec("get_current_weather", "weather", "Current weather in a city.", get_current_weather,
              {"city": _CITY, "units": _UNITS}, ["city"],
              _obj(city="string", temperature="number", units="string", condition="string",
                   humidity="integer", wind_kph="number")),
        _spec("get_forecast", "weather", "Daily weather forecast for a city.", get_forecast,
              {"city": _CITY, "days": _i("Number of days, 1-7 (default 3).", minimum=1,
                                         maximum=7, default=3),
               "units": _UNITS}, ["city"],
              _obj(city="string", units="string", days=_arr(_DAY_FORECAST))),
        _spec("get_air_quality", "weather", "Air quality index of a city.", get_air_quality,
              {"city": _CITY}, ["city"],
              _obj(city="string", aqi="integer", level="string", pm25="number")),
        _spec("get_weather_alerts", "weather", "Active weather alerts for a city.",
              get_weather_alerts, {"city": _CITY}, ["city"],
              _obj(city="string", alerts=_arr(_obj(type="string", severity="string",
                                                   until="string")))),
        # finance
        _spec("get_stock_quote", "finance", "Latest price of a stock.", get_stock_quote,
              {"symbol": _s("Ticker symbol, e.g. 'AAPL'.")}, ["symbol"],
              _obj(symbol="string", company="string", price="number", change_pct="number",
                   volume="integer", currency="string")),
        _spec("get_market_trend", "finance", "Price trend of a stock over a period.",
              get_market_trend,
              {"symbol": _s("Ticker symbol, e.g. 'AAPL'."),
               "period": _s("Time window (default month).", enum=list(PERIODS), default="month")},
              ["symbol"],
              _obj(symbol="string", period="string", prices=_arr("number"), change_pct="number",
                   trend="string")),
        _spec("get_exchange_rate", "finance", "Exchange rate between two currencies.",
              get_exchange_rate, {"base": _CUR, "target": _CUR}, ["base", "target"],
              _obj(base="string", target="string", rate="number")),
        _spec("convert_currency", "finance", "Convert an amount between currencies.",
              convert_currency,
              {"amount": _n("Amount to convert."), "from_currency": _CUR, "to_currency": _CUR},
              ["amount", "from_currency", "to_currency"],
              _obj(amount="number", from_currency="string", to_currency="string", rate="number",
                   converted="number")),
        _spec("get_crypto_price", "finance", "Price of a cryptocurrency.", get_crypto_price,
              {"coin": _s("Coin symbol.", enum=list(CRYPTOS)),
               "currency": _s("Quote currency (default USD).", enum=list(CURRENCIES),
                              default="USD")}, ["coin"],
              _obj(coin="string", currency="string", price="number", change_24h_pct="number")),
        # travel
        _spec("search_flights", "travel", "Search flights between two airports.", search_flights,
              {"origin": _s("Origin IATA code, e.g. 'LHR'."),
               "destination": _s("Destination IATA code."), "date": _DATE,
               "cabin": _s("Cabin class (default economy).", enum=list(CABINS),
                           default="economy")},
              ["origin", "destination", "date"],
              _obj(origin="string", destination="string", date="string", cabin="string",
                   flights=_arr(_FLIGHT))),
        _spec("search_hotels", "travel", "Search hotels in a city.", search_hotels,
              {"city": _CITY, "check_in": _s("Check-in date as YYYY-MM-DD."),
               "nights": _i("Nights (default 1).", minimum=1, maximum=30, default=1),
               "guests": _i("Guests (default 1).", minimum=1, maximum=8, default=1)},
              ["city", "check_in"],
              _obj(city="string", check_in="string", nights="integer", guests="integer",
                   hotels=_arr(_obj(name="string", stars="integer", price_per_night="number",
                                    rating="number")))),
        _spec("get_flight_status", "travel", "Status of a flight.", get_flight_status,
              {"flight_number": _s("Flight number, e.g. 'AF1234'.")}, ["flight_number"],
              _obj(flight_number="string", airline="string", status="string", origin="string",
                   destination="string", delay_min="integer", gate="string")),
        _spec("get_airport_info", "travel", "Details of an airport.", get_airport_info,
              {"code": _s("IATA code, e.g. 'CDG'.")}, ["code"],
              _obj(code="string", name="string", city="string", country="string",
                   terminals="integer", avg_security_wait_min="integer")),
        # files
        _spec("list_files", "files", "List a directory.", list_files,
              {"directory": _s("Directory path (default '.').", default=".")}, [],
              _obj(directory="string", entries=_arr(_ENTRY))),
        _spec("read_file", "files", "Read a text file.", read_file,
              {"path": _s("File path.")}, ["path"],
              _obj(path="string", content="string", truncated="boolean")),
        _spec("write_file", "files", "Write a text file.", write_file,
              {"path": _s("File path."), "content": _s("Text to write."),
               "overwrite": {"type": "boolean", "description": "Replace an existing file "
                                                               "(default false).",
                             "default": False}},
              ["path", "content"], _obj(path="string", bytes_written="integer")),
        _spec("delete_file", "files", "Delete a file.", delete_file,
              {"path": _s("File path.")}, ["path"], _obj(path="string", deleted="boolean")),
        _spec("search_files", "files", "Find lines containing a text in files.", search_files,
              {"pattern": _s("Text to find (case-insensitive)."),
               "directory": _s("Directory to search (default '.').", default=".")},
              ["pattern"],
              _obj(pattern="string", matches=_arr(_obj(path="string", line="integer",
                                                       text="string")))),
        _spec("get_file_info", "files", "Size and type of a file or directory.", get_file_info,
              {"path": _s("Path.")}, ["path"],
              _obj(path="string", type="string", size="integer", lines="integer")),
        # messaging
        _spec("send_email", "messaging", "Send an email.", send_email,
              {"to": _s("Recipient email address."), "subject": _s("Subject line."),
               "body": _s("Message body.")}, ["to", "subject", "body"],
              _obj(message_id="string", to="string", status="string")),
        _spec("send_sms", "messaging", "Send a text message.", send_sms,
              {"phone": _s("Phone number."), "message": _s("Text to send.")},
              ["phone", "message"],
              _obj(sms_id="string", phone="string", segments="integer", status="string")),
        _spec("list_messages", "messaging", "List recent emails in a folder.", list_messages,
              {"folder": _s("Mail folder (default inbox).", enum=list(FOLDERS), default="inbox"),
               "limit": _i("How many (default 5).", minimum=1, maximum=20, default=5)}, [],
              _obj(folder="string", messages=_arr(_obj(id="string", **{"from": "string"},
                                                       subject="string", unread="boolean")))),
        _spec("search_contacts", "messaging", "Find contacts by name.", search_contacts,
              {"name": _s("Name or part of it.")}, ["name"],
              _obj(query="string", contacts=_arr(_obj(name="string", email="string",
                                                      phone="string")))),
        # calendar
        _spec("create_event", "calendar", "Add an event to the calendar.", create_event,
              {"title": _s("Event title."), "date": _DATE,
               "start_time": _s("Start time as HH:MM (24h)."),
               "duration_minutes": _i("Length in minutes (default 60).", minimum=5,
                                      maximum=1440, default=60)},
              ["title", "date", "start_time"], {**_EVENT, "properties": {
                  **_EVENT["properties"], "status": {"type": "string"}}}),
        _spec("list_events", "calendar", "List the events on a date.", list_events,
              {"date": _DATE}, ["date"], _obj(date="string", events=_arr(_EVENT))),
        _spec("cancel_event", "calendar", "Cancel an event.", cancel_event,
              {"event_id": _s("Event id, e.g. 'EVT-1234'.")}, ["event_id"],
              _obj(event_id="string", status="string")),
        _spec("find_free_slot", "calendar", "First free slot of a given length on a date.",
              find_free_slot,
              {"date": _DATE, "duration_minutes": _i("Length in minutes.", minimum=5,
                                                     maximum=480)},
              ["date", "duration_minutes"],
              _obj(date="string", start_time="string", duration_minutes="integer",
                   found="boolean")),
        # e-commerce
        _spec("search_products", "ecommerce", "Search the shop's products.", search_products,
              {"query": _s("What to look for."),
               "max_price": _n("Highest price in USD (optional)."),
               "sort_by": _s("Order (default relevance).", enum=list(SORTS),
                             default="relevance"),
               "limit": _i("How many (default 5).", minimum=1, maximum=20, default=5)},
              ["query"], _obj(query="string", sort_by="string", results=_arr(_PRODUCT))),
        _spec("get_product_details", "ecommerce", "Details of a product.", get_product_details,
              {"product_id": _s("Product id, e.g. 'P-12345'.")}, ["product_id"],
              {**_PRODUCT, "properties": {**_PRODUCT["properties"],
                                          "description": {"type": "string"},
                                          "seller": {"type": "string"}}}),
        _spec("add_to_cart", "ecommerce", "Add a product to the cart.", add_to_cart,
              {"product_id": _s("Product id, e.g. 'P-12345'."),
               "quantity": _i("Quantity (default 1).", minimum=1, maximum=10, default=1)},
              ["product_id"],
              _obj(product_id="string", quantity="integer", cart_items="integer",
                   cart_total="number")),
        _spec("get_order_status", "ecommerce", "Status of an order.", get_order_status,
              {"order_id": _s("Order id, e.g. 'ORD-123456'.")}, ["order_id"],
              _obj(order_id="string", status="string", items="integer", total="number",
                   tracking_number="string")),
        _spec("track_package", "ecommerce", "Tracking history of a package.", track_package,
              {"tracking_number": _s("Tracking number, e.g. 'TRK0123456789'.")},
              ["tracking_number"],
              _obj(tracking_number="string", status="string", carrier="string",
                   history=_arr(_obj(event="string", location="string")))),
    ]
    out = {s.name: s for s in specs}
    assert len(out) == len(specs), "duplicate tool name in the catalogue"
    return out


def tools_by_domain(catalog: dict[str, ToolSpec] | None = None) -> dict[str, list[ToolSpec]]:
    """The catalogue's tools grouped by domain, domains in ``DOMAINS`` order."""
    catalog = catalog if catalog is not None else build_catalog()
    out: dict[str, list[ToolSpec]] = {}
    for d in DOMAINS:
        out[d] = [s for s in catalog.values() if s.domain == d]
    for s in catalog.values():
        if s.domain not in out:
            out.setdefault(s.domain, []).append(s)
    return out
