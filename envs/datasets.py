"""Task datasets: a seeded synthetic generator over the tool catalogue, and loaders for the
ToolACE / xLAM / Hammer files users have locally, plus our own JSONL format.

Synthetic tasks (``generate_synthetic``): natural user requests built from a few phrasings per
catalogue tool, with argument values drawn by a seeded faker. The gold is exactly recoverable
from the text: every string or number argument appears verbatim in the user messages, booleans
and enum values are said in words ("overwriting it", "in fahrenheit"), optional arguments
appear in the gold only when the text asks for them. Kinds: ``single`` (one call),
``parallel`` (2-3 calls in one message), ``multi_turn`` (2-3 user turns, one call each). Each
task offers its gold tools plus 2-4 distractor tools from the catalogue.

Loaders (``load_tasks``): a malformed row never stops a load and is never silently lost: it is
skipped and reported in ``LoadReport.skipped`` as ``(row_number, reason)`` (row_number is the
1-based line of a ``.jsonl`` file, or the 1-based item of a JSON array), and the count is logged.
Python-call strings (ToolACE's ``[f(a=1)]``) are parsed with ``ast``, never evaluated.

``mix_tasks`` draws a seeded mixture from several loaded sources, e.g. the DSCL / ToolRL recipe
of 2K ToolACE + 1K Hammer + 1K xLAM (DSCL paper, sec. 5.1 and appendix Table 7).

CLI: ``python -m reflrl.envs.datasets synth OUT_DIR --train 1000 --val 100 --test 100`` writes
the synthetic splits as our JSONL; ``python -m reflrl.envs.datasets check FILE [--fmt F]``
loads a file and prints how many rows were loaded and which were skipped, and why.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from faker import Faker

from .tools import catalog as C
from .tools.base import ToolSpec
from .tools.bfcl_backends import parse_python_calls, to_json_schema
from .types import Task, ToolCall

log = logging.getLogger(__name__)

KINDS = ("single", "parallel", "multi_turn")
FORMATS = ("auto", "xlam", "toolace", "hammer", "reflrl")

# =============================================================================================
# Synthetic generator
# =============================================================================================


class _Draw:
    """Seeded value sources for one generation run (a private Faker and random.Random)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.fake = Faker("en_US")
        self.fake.seed_instance(seed)

    def choice(self, seq):
        return self.rng.choice(list(seq))

    def maybe(self, p: float = 0.35) -> bool:
        return self.rng.random() < p

    def date(self) -> str:
        return f"2026-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"

    def time(self) -> str:
        return f"{self.rng.randint(7, 20):02d}:{self.choice(('00', '15', '30', '45'))}"

    def city(self) -> str:
        return self.choice(sorted(C.CITIES))

    def airports(self) -> tuple[str, str]:
        a, b = self.rng.sample(sorted(C.AIRPORTS), 2)
        return a, b

    def sentence(self, words: int = 4) -> str:
        return self.fake.sentence(nb_words=words, variable_nb_words=False)

    def title(self) -> str:
        return self.choice((
            "Team sync", "Dentist", "Budget review", "Gym", "Project kickoff", "1:1 with "
            + self.fake.first_name(), "Lunch with " + self.fake.first_name(), "Call "
            + self.fake.first_name(), "Design review", "Yoga class"))

    def email(self) -> str:
        domain = self.choice(("example.com", "example.org", "mail.com"))
        return f"{self.fake.first_name().lower()}@{domain}"

    def phone(self) -> str:
        return f"+1 555 {self.rng.randint(100, 999)} {self.rng.randint(1000, 9999)}"

    def filename(self) -> str:
        return f"{self.fake.word()}_{self.fake.word()}.{self.choice(('txt', 'md', 'csv'))}"


def _q(text: str, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return text, args


# Each generator returns (sentence, arguments). Sentences start with a plain word, never a value.

def _g_weather(d: _Draw):
    city = d.city()
    if d.maybe():
        u = d.choice(C.UNITS)
        return _q(d.choice((f"What's the weather in {city} right now, in {u}?",
                            f"Tell me the current temperature in {city} in {u}.")),
                  {"city": city, "units": u})
    return _q(d.choice((f"What's the weather like in {city}?",
                        f"How is the weather in {city} right now?",
                        f"Check the current weather for {city}.")), {"city": city})


def _g_forecast(d: _Draw):
    city, days = d.city(), d.rng.randint(2, 7)
    args: dict[str, Any] = {"city": city, "days": days}
    if d.maybe(0.25):
        args["units"] = u = d.choice(C.UNITS)
        return _q(f"Give me the {days}-day forecast for {city} in {u}.", args)
    return _q(d.choice((f"What's the forecast for {city} for the next {days} days?",
                        f"Get me a {days}-day weather forecast for {city}.")), args)


def _g_air(d: _Draw):
    city = d.city()
    return _q(d.choice((f"How is the air quality in {city}?",
                        f"What's the AQI in {city} today?",
                        f"Check air pollution levels in {city}.")), {"city": city})


def _g_alerts(d: _Draw):
    city = d.city()
    return _q(d.choice((f"Are there any weather alerts for {city}?",
                        f"List active weather warnings in {city}.")), {"city": city})


def _g_quote(d: _Draw):
    s = d.choice(sorted(C.TICKERS))
    return _q(d.choice((f"What's the stock price of {s}?", f"Get me a quote for {s}.",
                        f"How much is {s} trading at?")), {"symbol": s})


def _g_trend(d: _Draw):
    s = d.choice(sorted(C.TICKERS))
    if d.maybe(0.7):
        p = d.choice(C.PERIODS)
        return _q(d.choice((f"How has {s} moved over the past {p}?",
                            f"Show the market trend of {s} for the last {p}.")),
                  {"symbol": s, "period": p})
    return _q(f"What's the recent market trend for {s}?", {"symbol": s})


def _g_rate(d: _Draw):
    a, b = d.rng.sample(C.CURRENCIES, 2)
    return _q(d.choice((f"What's the exchange rate from {a} to {b}?",
                        f"How many {b} do I get for one {a}?")), {"base": a, "target": b})


def _g_convert(d: _Draw):
    a, b = d.rng.sample(C.CURRENCIES, 2)
    amt: Any = d.rng.randint(5, 5000) if d.maybe(0.7) else round(d.rng.uniform(1, 500), 2)
    return _q(d.choice((f"Convert {amt} {a} to {b}.", f"How much is {amt} {a} in {b}?")),
              {"amount": amt, "from_currency": a, "to_currency": b})


def _g_crypto(d: _Draw):
    c = d.choice(C.CRYPTOS)
    if d.maybe():
        cur = d.choice(C.CURRENCIES)
        return _q(f"What's the price of {c} in {cur}?", {"coin": c, "currency": cur})
    return _q(d.choice((f"How much is {c} worth right now?", f"Get the current {c} price.")),
              {"coin": c})


def _g_flights(d: _Draw):
    o, t = d.airports()
    date = d.date()
    args: dict[str, Any] = {"origin": o, "destination": t, "date": date}
    if d.maybe(0.3):
        args["cabin"] = cab = d.choice(C.CABINS[1:])
        return _q(f"Find {cab} class flights from {o} to {t} on {date}.", args)
    return _q(d.choice((f"Find flights from {o} to {t} on {date}.",
                        f"Search for a flight {o} to {t} departing {date}.")), args)


def _g_hotels(d: _Draw):
    city, date = d.city(), d.date()
    args: dict[str, Any] = {"city": city, "check_in": date}
    extra = ""
    if d.maybe(0.5):
        args["nights"] = n = d.rng.randint(2, 9)
        extra += f" for {n} nights"
    if d.maybe(0.3):
        args["guests"] = g = d.rng.randint(2, 5)
        extra += f" for {g} guests"
    return _q(d.choice((f"Find hotels in {city} from {date}{extra}.",
                        f"Search hotels in {city} checking in {date}{extra}.")), args)


def _g_flight_status(d: _Draw):
    fn = f"{d.choice(sorted(C.AIRLINES))}{d.rng.randint(10, 9999)}"
    return _q(d.choice((f"What's the status of flight {fn}?", f"Is flight {fn} on time?")),
              {"flight_number": fn})


def _g_airport(d: _Draw):
    code = d.choice(sorted(C.AIRPORTS))
    return _q(d.choice((f"Tell me about the airport {code}.",
                        f"Get airport details for {code}.")), {"code": code})


def _g_list_files(d: _Draw):
    if d.maybe(0.5):
        dr = d.choice(("reports", "logs"))
        return _q(d.choice((f"List the files in the {dr} folder.",
                            f"What's inside the {dr} directory?")), {"directory": dr})
    return _q(d.choice(("List the files in my workspace.", "Show me all my files.")), {})


def _g_read(d: _Draw):
    p = d.choice(C.SANDBOX_FILES)
    return _q(d.choice((f"Read the file {p}.", f"Show me what's in {p}.",
                        f"Open {p} and show its content.")), {"path": p})


def _g_write(d: _Draw):
    p, text = d.filename(), d.sentence(4)
    args: dict[str, Any] = {"path": p, "content": text}
    if d.maybe(0.25):
        args["overwrite"] = True
        return _q(f"Write '{text}' to {p}, overwriting it if it exists.", args)
    return _q(d.choice((f"Write '{text}' to {p}.", f"Save the text '{text}' in {p}.",
                        f"Create a file {p} containing '{text}'.")), args)


def _g_delete(d: _Draw):
    p = d.choice(C.SANDBOX_FILES)
    return _q(d.choice((f"Delete the file {p}.", f"Remove {p} from my files.")), {"path": p})


def _g_search_files(d: _Draw):
    pat = d.choice(("ERROR", "WARN", "revenue", "version", "debug", "INFO"))
    if d.maybe(0.4):
        dr = d.choice(("reports", "logs"))
        return _q(f"Search the {dr} folder for '{pat}'.", {"pattern": pat, "directory": dr})
    return _q(d.choice((f"Search my files for '{pat}'.", f"Find lines containing '{pat}'.")),
              {"pattern": pat})


def _g_file_info(d: _Draw):
    p = d.choice(C.SANDBOX_FILES + ("reports", "logs"))
    return _q(d.choice((f"How big is {p}?", f"Get file info for {p}.")), {"path": p})


def _g_email(d: _Draw):
    to, subj, body = d.email(), d.sentence(2).rstrip("."), d.sentence(5)
    return _q(d.choice((f"Email {to} with subject '{subj}' and body '{body}'",
                        f"Send an email to {to}, subject '{subj}', saying '{body}'")),
              {"to": to, "subject": subj, "body": body})


def _g_sms(d: _Draw):
    ph, msg = d.phone(), d.sentence(4)
    return _q(d.choice((f"Text {ph}: '{msg}'", f"Send an SMS to {ph} saying '{msg}'")),
              {"phone": ph, "message": msg})


def _g_list_messages(d: _Draw):
    args: dict[str, Any] = {}
    where = ""  # the default folder (inbox) is never named, so the gold never needs it
    if d.maybe(0.5):
        args["folder"] = folder = d.choice(C.FOLDERS[1:])
        where = f" in the {folder} folder"
    if d.maybe(0.5):
        args["limit"] = n = d.rng.randint(2, 10)
        return _q(f"Show my last {n} emails{where}.", args)
    return _q(d.choice((f"List my recent emails{where}.", f"Show my latest messages{where}.")),
              args)


def _g_contacts(d: _Draw):
    name = d.fake.first_name() if d.maybe(0.6) else d.fake.name()
    return _q(d.choice((f"Find the contact details for {name}.",
                        f"Look up {name} in my contacts.")), {"name": name})


def _g_create_event(d: _Draw):
    title, date, t = d.title(), d.date(), d.time()
    args: dict[str, Any] = {"title": title, "date": date, "start_time": t}
    if d.maybe(0.4):
        args["duration_minutes"] = m = d.choice((15, 30, 45, 90, 120))
        return _q(f"Schedule '{title}' on {date} at {t} for {m} minutes.", args)
    return _q(d.choice((f"Schedule '{title}' on {date} at {t}.",
                        f"Add '{title}' to my calendar on {date} at {t}.")), args)


def _g_list_events(d: _Draw):
    date = d.date()
    return _q(d.choice((f"What's on my calendar on {date}?", f"List my events for {date}.")),
              {"date": date})


def _g_cancel_event(d: _Draw):
    eid = f"EVT-{d.rng.randint(1000, 9999)}"
    return _q(d.choice((f"Cancel event {eid}.", f"Please cancel the meeting {eid}.")),
              {"event_id": eid})


def _g_free_slot(d: _Draw):
    date, m = d.date(), d.choice((15, 30, 45, 60, 90, 120))
    return _q(d.choice((f"Find a free {m}-minute slot on {date}.",
                        f"When am I free for {m} minutes on {date}?")),
              {"date": date, "duration_minutes": m})


_PRODUCTS = ("headphones", "desk lamp", "backpack", "coffee maker", "running shoes", "keyboard",
             "water bottle", "phone case", "yoga mat", "kettle", "monitor", "notebook")


def _g_products(d: _Draw):
    q = d.choice(_PRODUCTS)
    args: dict[str, Any] = {"query": q}
    text = f"Search the shop for {q}"
    if d.maybe(0.4):
        args["max_price"] = p = d.choice((20, 25, 50, 75, 100, 150, 200))
        text += f" under ${p}"
    if d.maybe(0.35):
        args["sort_by"] = s = d.choice(C.SORTS[1:])
        text += f", sorted by {s}"
    if d.maybe(0.25):
        args["limit"] = n = d.rng.randint(2, 10)
        text += f", show {n} results"
    return _q(text + ".", args)


def _g_product(d: _Draw):
    pid = f"P-{d.rng.randint(10000, 99999)}"
    return _q(d.choice((f"Show me the details of product {pid}.", f"Tell me about item {pid}.")),
              {"product_id": pid})


def _g_cart(d: _Draw):
    pid = f"P-{d.rng.randint(10000, 99999)}"
    if d.maybe(0.4):
        n = d.rng.randint(2, 6)
        return _q(f"Add {n} of product {pid} to my cart.", {"product_id": pid, "quantity": n})
    return _q(d.choice((f"Add product {pid} to my cart.", f"Put item {pid} in the cart.")),
              {"product_id": pid})


def _g_order(d: _Draw):
    oid = f"ORD-{d.rng.randint(100000, 999999)}"
    return _q(d.choice((f"What's the status of order {oid}?", f"Where is my order {oid}?")),
              {"order_id": oid})


def _g_track(d: _Draw):
    tn = f"TRK{d.rng.randint(10**9, 10**10 - 1)}"
    return _q(d.choice((f"Track package {tn}.", f"Where is my package {tn}?")),
              {"tracking_number": tn})


TEMPLATES: dict[str, Callable[[_Draw], tuple[str, dict[str, Any]]]] = {
    "get_current_weather": _g_weather, "get_forecast": _g_forecast,
    "get_air_quality": _g_air, "get_weather_alerts": _g_alerts,
    "get_stock_quote": _g_quote, "get_market_trend": _g_trend, "get_exchange_rate": _g_rate,
    "convert_currency": _g_convert, "get_crypto_price": _g_crypto,
    "search_flights": _g_flights, "search_hotels": _g_hotels,
    "get_flight_status": _g_flight_status, "get_airport_info": _g_airport,
    "list_files": _g_list_files, "read_file": _g_read, "write_file": _g_write,
    "delete_file": _g_delete, "search_files": _g_search_files, "get_file_info": _g_file_info,
    "send_email": _g_email, "send_sms": _g_sms, "list_messages": _g_list_messages,
    "search_contacts": _g_contacts,
    "create_event": _g_create_event, "list_events": _g_list_events,
    "cancel_event": _g_cancel_event, "find_free_slot": _g_free_slot,
    "search_products": _g_products, "get_product_details": _g_product,
    "add_to_cart": _g_cart, "get_order_status": _g_order, "track_package": _g_track,
}

_JOIN = ("Also, ", "And ", "Then ", "Plus, ")
_NEXT = ("Thanks. Now ", "Next, ", "Great. ", "OK, now ", "")


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


def _connect(connector: str, sentence: str) -> str:
    """Prefix a connector; lower the sentence's first letter only after a comma-style one."""
    if not connector or connector.rstrip().endswith("."):
        return connector + sentence
    return connector + _lower_first(sentence)


def _task_id(query: str, turns: list[str]) -> str:
    h = hashlib.blake2b("\x1f".join([query, *turns]).encode(), digest_size=6).hexdigest()
    return f"syn-{h}"


def _resolve_tools(tools) -> dict[str, ToolSpec]:
    cat = C.build_catalog()
    if tools is None:
        pool = cat
    elif isinstance(tools, dict):
        pool = dict(tools)
    else:
        names = list(tools)
        unknown = [n for n in names if n not in cat]
        if unknown:
            raise ValueError(f"unknown catalogue tools: {', '.join(unknown)}")
        pool = {n: cat[n] for n in names}
    missing = [n for n in pool if n not in TEMPLATES]
    if missing:
        raise ValueError(f"no query templates for tools: {', '.join(missing)}")
    if not pool:
        raise ValueError("no tools to generate tasks for")
    return pool


def _offer(d: _Draw, gold_names: list[str], pool: dict[str, ToolSpec],
           catalog: dict[str, ToolSpec]) -> list[dict[str, Any]]:
    """Gold tools plus 2-4 distractors (half from the gold's domains when possible), shuffled."""
    names = list(dict.fromkeys(gold_names))
    others = sorted(n for n in catalog if n not in names)
    k = min(d.rng.randint(2, 4), len(others))
    domains = {catalog[n].domain for n in names if n in catalog}
    near = [n for n in others if catalog[n].domain in domains]
    picked = d.rng.sample(near, min(len(near), k // 2)) if near else []
    rest = [n for n in others if n not in picked]
    picked += d.rng.sample(rest, k - len(picked))
    offered = names + picked
    d.rng.shuffle(offered)
    return [(pool.get(n) or catalog[n]).schema() for n in offered]


_CHAINS = (  # coherent multi-turn flows: (first tool, follow-up tool, follow-up builder)
    ("write_file", "read_file",
     lambda d, a: (d.choice((f"Read {a['path']} back to me.",
                             f"Show me what's in {a['path']} now.")),
                   "read_file", {"path": a["path"]})),
    ("create_event", "list_events",
     lambda d, a: (f"List my events for {a['date']}.", "list_events", {"date": a["date"]})),
    ("search_flights", "get_airport_info",
     lambda d, a: (f"Get airport details for {a['destination']}.", "get_airport_info",
                   {"code": a["destination"]})),
    ("get_stock_quote", "get_market_trend",
     lambda d, a: (f"How has {a['symbol']} moved over the past week?", "get_market_trend",
                   {"symbol": a["symbol"], "period": "week"})),
)


def _fresh(d: _Draw, name: str, earlier: list[ToolCall]) -> tuple[str, dict[str, Any]]:
    """A request for ``name`` whose file path no earlier call of the task uses (deleting and
    reading the same file in one order-free parallel message would be ill-posed)."""
    used = {c.arguments.get("path") for c in earlier} - {None}
    for _ in range(50):
        text, args = TEMPLATES[name](d)
        if args.get("path") not in used:
            return text, args
    return text, args


def _one(d: _Draw, kind: str, names: list[str], pool, catalog) -> Task:
    if kind == "single":
        name = d.choice(names)
        text, args = TEMPLATES[name](d)
        gold, query, turns = [[ToolCall(name, args)]], text, []
    elif kind == "parallel":
        k = d.rng.randint(2, 3)
        if d.maybe(0.4):  # the same tool with different values
            picked = [d.choice(names)] * k
        else:
            picked = d.rng.sample(names, min(k, len(names)))
        parts, calls = [], []
        for i, name in enumerate(picked):
            text, args = _fresh(d, name, calls)
            parts.append(text if i == 0 else _connect(d.choice(_JOIN), text))
            calls.append(ToolCall(name, args))
        query, gold, turns = " ".join(parts), [calls], []
    elif kind == "multi_turn":
        chains = [c for c in _CHAINS if c[0] in names and c[1] in names]
        if chains and d.maybe(0.35):
            first, _, follow = d.choice(chains)
            t1, a1 = TEMPLATES[first](d)
            t2, n2, a2 = follow(d, a1)
            msgs, gold = [t1, t2], [[ToolCall(first, a1)], [ToolCall(n2, a2)]]
        else:
            msgs, gold = [], []
            for _ in range(d.rng.randint(2, 3)):
                name = d.choice(names)
                text, args = _fresh(d, name, [c for turn in gold for c in turn])
                msgs.append(text)
                gold.append([ToolCall(name, args)])
        query = msgs[0]
        turns = [_connect(d.choice(_NEXT), m) for m in msgs[1:]]
    else:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")
    gold_names = [c.name for turn in gold for c in turn]
    tools = _offer(d, gold_names, pool, catalog)
    domains = sorted({catalog[n].domain for n in gold_names if n in catalog})
    return Task(id=_task_id(query, turns), query=query, tools=tools, gold=gold, kind=kind,
                turns=turns, meta={"source": "synthetic", "domains": domains})


def generate_synthetic(n: int, seed: int, kinds: Iterable[str] = ("single", "parallel"),
                       tools=None) -> list[Task]:
    """``n`` distinct synthetic tasks (distinct query texts), reproducible from ``seed``.

    kinds:  cycled in order ("single", "parallel", "multi_turn").
    tools:  None (whole catalogue), a list of catalogue tool names, or a dict of ToolSpecs;
            gold calls use only these tools (distractors come from the whole catalogue).
    Ids are ``syn-<hash of the user messages>``: the same text always gets the same id.
    """
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds must not be empty")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown task kind {k!r}; known: {', '.join(KINDS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = _resolve_tools(tools)
    catalog = C.build_catalog()
    names = sorted(pool)
    d = _Draw(seed)
    out: list[Task] = []
    seen: set[str] = set()
    misses = 0  # duplicates in a row: the tools' phrasings and values are used up
    while len(out) < n:
        task = _one(d, kinds[len(out) % len(kinds)], names, pool, catalog)
        if task.query in seen:
            misses += 1
            if misses > 500:
                raise ValueError(f"could only make {len(out)} distinct tasks of {n} with tools "
                                 f"{names}: use more tools or fewer tasks")
            continue
        misses = 0
        seen.add(task.query)
        task.meta["seed"] = seed
        out.append(task)
    return out


def synthetic_splits(n_train: int, n_val: int, n_test: int, seed: int,
                     kinds: Iterable[str] = ("single", "parallel"), tools=None
                     ) -> dict[str, list[Task]]:
    """Train/val/test synthetic splits with no overlap by query text or by id.

    One pool of distinct tasks is generated and cut in order, so every split has the kinds in
    the same proportions.
    """
    pool = generate_synthetic(n_train + n_val + n_test, seed, kinds=kinds, tools=tools)
    splits = {"train": pool[:n_train], "val": pool[n_train:n_train + n_val],
              "test": pool[n_train + n_val:]}
    for name, tasks in splits.items():
        for t in tasks:
            t.meta["split"] = name
    return splits


# =============================================================================================
# Loading and saving
# =============================================================================================


@dataclass
class LoadReport:
    """What ``load_tasks`` made of a file: the tasks, and every skipped row with the reason."""

    tasks: list[Task]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    path: str = ""
    fmt: str = "auto"

    @property
    def n_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        s = f"{self.path}: loaded {len(self.tasks)} tasks, skipped {self.n_skipped} malformed rows"
        for no, reason in self.skipped[:10]:
            s += f"\n  row {no}: {reason}"
        if self.n_skipped > 10:
            s += f"\n  ... and {self.n_skipped - 10} more"
        return s


class RowError(ValueError):
    """A dataset row that cannot become a Task; the message says why."""


def _json_field(row: dict[str, Any], key: str) -> Any:
    if key not in row:
        raise RowError(f"missing field {key!r}")
    v = row[key]
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise RowError(f"field {key!r} is not valid JSON: {e.msg} at char {e.pos}") from None
    return v


_PY_TYPES = {"str": "string", "string": "string", "int": "integer", "integer": "integer",
             "float": "number", "number": "number", "double": "number", "bool": "boolean",
             "boolean": "boolean", "dict": "object", "object": "object", "list": "array",
             "array": "array", "tuple": "array", "set": "array"}


def _xlam_type(t: Any) -> tuple[str | None, bool]:
    """xLAM/Hammer parameter type string -> (JSON type or None, optional?)."""
    if not isinstance(t, str):
        return None, False
    s = t.strip()
    optional = "optional" in s.lower()
    s = re.sub(r"(?i),?\s*optional", "", s).strip()
    m = re.match(r"(?i)^optional\[(.*)\]$", s)
    if m:
        s, optional = m.group(1), True
    base = re.split(r"[\[\s|,]", s, maxsplit=1)[0].lower()
    return _PY_TYPES.get(base), optional


def _normalize_tool(tool: Any) -> dict[str, Any]:
    """A tool description (OpenAI, BFCL ``dict`` types, or xLAM's param dict) -> our schema."""
    if not isinstance(tool, dict):
        raise RowError(f"a tool is a {type(tool).__name__}, not an object")
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    name = tool.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RowError("a tool has no name")
    params = tool.get("parameters") or {}
    if not isinstance(params, dict):
        raise RowError(f"tool {name!r}: parameters is not an object")
    if "properties" in params or params.get("type") in ("object", "dict"):
        schema = to_json_schema(params)
        schema["type"] = "object"
        schema.setdefault("properties", {})
        if not isinstance(schema.get("required", []), list):
            schema["required"] = []
    else:  # xLAM style: {param: {"type": "str, optional", "description", "default"}}
        props, required = {}, []
        for p, spec in params.items():
            if not isinstance(spec, dict):
                raise RowError(f"tool {name!r}: parameter {p!r} is not an object")
            jt, optional = _xlam_type(spec.get("type"))
            prop: dict[str, Any] = {}
            if jt:
                prop["type"] = jt
            if spec.get("description"):
                prop["description"] = str(spec["description"])
            if "default" in spec:
                prop["default"] = spec["default"]
            props[p] = prop
            if not optional and "default" not in spec:
                required.append(p)
        schema = {"type": "object", "properties": props, "required": required}
    return {"name": name, "description": str(tool.get("description") or ""), "parameters": schema}


def _tools_list(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RowError(f"tools is a {type(raw).__name__}, not a list")
    tools = [_normalize_tool(t) for t in raw]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RowError("two tools share a name")
    return tools


def _call_from(obj: Any) -> ToolCall:
    if not isinstance(obj, dict):
        raise RowError(f"a call is a {type(obj).__name__}, not an object")
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI tool_calls entry
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise RowError("a call has no name")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RowError(f"call {name!r}: arguments are not valid JSON") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RowError(f"call {name!r}: arguments are not an object")
    return ToolCall(name=name, arguments=args)


def _check_gold(gold: list[list[ToolCall]], tools: list[dict[str, Any]]) -> None:
    names = {t["name"] for t in tools}
    for turn in gold:
        for c in turn:
            if c.name not in names:
                raise RowError(f"gold calls {c.name!r}, which is not among the row's tools")


def _row_xlam(row: dict[str, Any], source: str) -> dict[str, Any]:
    tools = _tools_list(_json_field(row, "tools"))
    answers = _json_field(row, "answers")
    if not isinstance(answers, list):
        raise RowError("answers is not a list")
    calls = [_call_from(a) for a in answers]
    _check_gold([calls], tools)
    query = row.get("query")
    if not isinstance(query, str) or not query.strip():
        raise RowError("query is missing or empty")
    kind = "parallel" if len(calls) > 1 else "single"
    meta: dict[str, Any] = {"source": source}
    if not calls:
        meta["no_call"] = True
    return {"rid": row.get("id"), "query": query, "tools": tools, "gold": [calls], "kind": kind,
            "turns": [], "meta": meta}


_ROLE = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "tool": "tool", "function": "tool", "observation": "tool", "system": "system"}


def _extract_tools_from_system(system: str) -> list[Any]:
    """The JSON list of functions ToolACE embeds in its system prompt."""
    dec = json.JSONDecoder()
    start = system.find("[{")
    while start != -1:
        try:
            val, _ = dec.raw_decode(system, start)
            if isinstance(val, list) and val and all(isinstance(t, dict) and "name" in t
                                                     for t in val):
                return val
        except json.JSONDecodeError:
            pass
        start = system.find("[{", start + 1)
    raise RowError("no JSON list of functions found in the system prompt")


def _parse_toolace_calls(text: str, tool_names: list[str]) -> list[ToolCall]:
    """``[f(a=1), g(b="x")]`` with ast; tool names that are not identifiers are masked first."""
    masked, back = text, {}
    for i, n in enumerate(sorted(tool_names, key=len, reverse=True)):
        if not n.isidentifier() and n in masked:
            key = f"__reflrl_tool_{i}__"
            masked = masked.replace(n + "(", key + "(")
            back[key] = n
    try:
        calls = parse_python_calls(masked)
    except ValueError as e:
        raise RowError(f"unparsable call list {text[:80]!r}: {e}") from None
    return [ToolCall(back.get(c.name, c.name), c.arguments) for c in calls]


def _looks_like_calls(text: str) -> bool:
    s = text.strip()
    return s.startswith("[") and s.endswith("]") and "(" in s


def _row_toolace(row: dict[str, Any], source: str) -> dict[str, Any]:
    if "tools" in row and row["tools"] not in (None, "", []):
        raw_tools = _json_field(row, "tools")
    else:
        system = row.get("system")
        if not isinstance(system, str):
            raise RowError("no tools: neither a 'tools' field nor a system prompt")
        raw_tools = _extract_tools_from_system(system)
    tools = _tools_list(raw_tools)
    names = [t["name"] for t in tools]
    conv = row.get("conversations", row.get("conversation", row.get("messages")))
    if isinstance(conv, str):
        conv = _json_field({"c": conv}, "c")
    if not isinstance(conv, list) or not conv:
        raise RowError("conversations is missing or empty")
    user_msgs: list[str] = []
    gold: list[list[ToolCall]] = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise RowError(f"message {i} is not an object")
        role = _ROLE.get(str(m.get("from", m.get("role", ""))).lower())
        text = m.get("value", m.get("content"))
        if role is None:
            raise RowError(f"message {i} has an unknown role {m.get('from', m.get('role'))!r}")
        if role == "user":
            if not isinstance(text, str):
                raise RowError(f"message {i}: user text is missing")
            user_msgs.append(text)
            gold.append([])
        elif role == "assistant":
            if not user_msgs:
                raise RowError(f"message {i}: assistant speaks before any user message")
            if m.get("tool_calls"):
                gold[-1].extend(_call_from(c) for c in m["tool_calls"])
            elif isinstance(text, str) and _looks_like_calls(text):
                gold[-1].extend(_parse_toolace_calls(text, names))
    if not user_msgs:
        raise RowError("no user message")
    _check_gold(gold, tools)
    if len(user_msgs) == 1:
        kind = "parallel" if len(gold[0]) > 1 else "single"
    else:
        kind = "multi_turn"
    meta: dict[str, Any] = {"source": source}
    if not any(gold):
        meta["no_call"] = True
    return {"rid": row.get("id"), "query": user_msgs[0], "tools": tools, "gold": gold,
            "kind": kind, "turns": user_msgs[1:], "meta": meta}


def _row_reflrl(row: dict[str, Any], source: str) -> dict[str, Any]:
    for key in ("id", "query", "tools", "gold"):
        if key not in row:
            raise RowError(f"missing field {key!r}")
    if not isinstance(row["id"], str) or not row["id"]:
        raise RowError("id must be a non-empty string")
    if not isinstance(row["query"], str):
        raise RowError("query must be a string")
    if not isinstance(row["tools"], list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in row["tools"]):
        raise RowError("tools must be a list of objects with a name")
    if not isinstance(row["gold"], list) or not all(isinstance(t, list) for t in row["gold"]):
        raise RowError("gold must be a list of lists of calls")
    gold = [[_call_from(c) for c in turn] for turn in row["gold"]]
    kind = row.get("kind", "single")
    if kind not in KINDS:
        raise RowError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    turns = row.get("turns") or []
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise RowError("turns must be a list of strings")
    ic = row.get("initial_config")
    if ic is not None and not isinstance(ic, dict):
        raise RowError("initial_config must be an object or null")
    meta = row.get("meta") or {}
    if not isinstance(meta, dict):
        raise RowError("meta must be an object")
    return {"rid": row["id"], "query": row["query"], "tools": row["tools"], "gold": gold,
            "kind": kind, "turns": turns, "initial_config": ic, "meta": meta, "keep_id": True}


_PARSERS = {"xlam": _row_xlam, "hammer": _row_xlam, "toolace": _row_toolace,
            "reflrl": _row_reflrl}


def _detect(row: dict[str, Any]) -> str:
    if "gold" in row and "query" in row:
        return "reflrl"
    if any(k in row for k in ("conversations", "conversation")) or (
            "system" in row and "messages" in row):
        return "toolace"
    if "query" in row and "answers" in row:
        return "xlam"
    raise RowError(f"cannot tell the row's format from its fields {sorted(row)[:8]}")


def _iter_rows(path: Path) -> Iterable[tuple[int, Any]]:
    """(1-based row number, parsed JSON or a RowError) for a .json array or a .jsonl file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # maybe JSON lines in a .json file
        if data is not None:
            if isinstance(data, dict):
                for key in ("data", "rows", "examples", "train"):
                    if isinstance(data.get(key), list):
                        data = data[key]
                        break
                else:
                    data = [data]
            if not isinstance(data, list):
                raise ValueError(f"{path}: top level is a {type(data).__name__}, not a list")
            yield from enumerate(data, 1)
            return
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield no, json.loads(line)
        except json.JSONDecodeError as e:
            yield no, RowError(f"invalid JSON: {e.msg} at column {e.colno}")


def load_tasks(path: str | Path, fmt: str = "auto") -> LoadReport:
    """Tasks from a .json (array) or .jsonl file in one of ``FORMATS``.

    fmt="auto" decides per row (ours: has ``gold``; ToolACE: has ``conversations``; xLAM and
    Hammer: have ``query`` and ``answers``). Malformed rows are skipped and reported in
    ``LoadReport.skipped`` as (row number, reason); the count is logged as a warning.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; known: {', '.join(FORMATS)}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    report = LoadReport(tasks=[], path=str(path), fmt=fmt)
    seen_ids: set[str] = set()
    stem = path.stem
    for no, row in _iter_rows(path):
        try:
            if isinstance(row, RowError):
                raise row
            if not isinstance(row, dict):
                raise RowError(f"row is a {type(row).__name__}, not an object")
            rfmt = _detect(row) if fmt == "auto" else fmt
            if fmt == "auto" and rfmt == "xlam" and "hammer" in stem.lower():
                rfmt = "hammer"
            parsed = _PARSERS[rfmt](row, rfmt)
            rid = parsed["rid"]
            if parsed.get("keep_id"):
                tid = str(rid)
            else:
                tid = f"{rfmt}-{rid}" if rid not in (None, "") else f"{rfmt}-{stem}-{no}"
            if tid in seen_ids:
                raise RowError(f"duplicate task id {tid!r}")
            meta = dict(parsed["meta"])
            meta.setdefault("source", rfmt)
            if rfmt != "reflrl":
                meta.update({"file": path.name, "row": no})
            task = Task(id=tid, query=parsed["query"], tools=parsed["tools"],
                        gold=parsed["gold"], kind=parsed["kind"], turns=parsed["turns"],
                        initial_config=parsed.get("initial_config"), meta=meta)
        except RowError as e:
            report.skipped.append((no, str(e)))
            continue
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            report.skipped.append((no, f"{type(e).__name__}: {e}"))
            continue
        seen_ids.add(tid)
        report.tasks.append(task)
    if report.skipped:
        log.warning("%s: skipped %d malformed rows (first: row %d: %s)", path,
                    report.n_skipped, *report.skipped[0])
    log.info("%s: loaded %d tasks", path, len(report.tasks))
    return report


def task_to_dict(task: Task) -> dict[str, Any]:
    """Our JSONL row for a Task (ToolCalls as {"name", "arguments"} dicts)."""
    d = asdict(task)
    d["gold"] = [[c.to_dict() for c in turn] for turn in task.gold]
    return d


def save_tasks(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL in our format (read back with ``load_tasks(path, fmt="reflrl")``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps(task_to_dict(t), ensure_ascii=False) + "\n")
    return path


def mix_tasks(sources: dict[str, list[Task]], counts: dict[str, int], seed: int) -> list[Task]:
    """A seeded mixture: ``counts[name]`` tasks drawn without replacement from
    ``sources[name]``, shuffled together (DSCL sec. 5.1: 2K ToolACE + 1K Hammer + 1K xLAM).

    Raises ValueError when a source is unknown or has fewer tasks than asked for.
    """
    rng = random.Random(seed)
    out: list[Task] = []
    for name in sorted(counts):
        if name not in sources:
            raise ValueError(f"mix: no source named {name!r}; have {sorted(sources)}")
        pool, k = sources[name], counts[name]
        if k > len(pool):
            raise ValueError(f"mix: source {name!r} has {len(pool)} tasks, {k} asked")
        out.extend(rng.sample(pool, k))
    ids = [t.id for t in out]
    if len(set(ids)) != len(ids):
        raise ValueError("mix: two sources share task ids; give them distinct ids first")
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``synth``: dump synthetic splits; ``check``: load a file and report skipped rows."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m reflrl.envs.datasets")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("synth", help="write synthetic train/val/test splits as JSONL")
    sp.add_argument("out_dir")
    sp.add_argument("--train", type=int, default=1000)
    sp.add_argument("--val", type=int, default=100)
    sp.add_argument("--test", type=int, default=100)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--kinds", default="single,parallel,multi_turn")
    cp = sub.add_parser("check", help="load a dataset file and report malformed rows")
    cp.add_argument("path")
    cp.add_argument("--fmt", default="auto", choices=FORMATS)
    a = ap.parse_args(argv)
    if a.cmd == "synth":
        kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
        splits = synthetic_splits(a.train, a.val, a.test, a.seed, kinds=kinds)
        for name, tasks in splits.items():
            path = save_tasks(tasks, Path(a.out_dir) / f"{name}.jsonl")
            print(f"{path}: {len(tasks)} tasks")
        return 0
    report = load_tasks(a.path, fmt=a.fmt)
    print(report.summary())
    kinds = Counter(t.kind for t in report.tasks)
    print("kinds: " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
