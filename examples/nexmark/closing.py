"""The functions of NEXMark Q4 and Q6 (examples/nexmark/q4.yaml, q6.yaml, closing_pipeline.py):
both close each auction in a first keyed stage (by auction) with an event-time timer at its
`expires`, emitting its winning bid, then average closing prices in a second keyed stage (Q4:
per category, the built-in `mean`; Q6: per seller, over its last 10 closed auctions).
tests/test_nexmark_closing.py compares their answers with DuckDB's (sql/q4.sql, sql/q6.sql).
"""

from __future__ import annotations

import json
from typing import Any

from keyshift.runtime.job_graph import FieldType

Record = dict[str, Any]
Q6_LAST = 10  # Q6 averages each seller's last 10 closed auctions
AUCTION_FIELDS = ("reserve", "expires", "category", "seller")
# What the first stage's records carry: an auction or a bid, keyed by the auction's id.
AUCTION_OR_BID_FIELDS: dict[str, FieldType] = {
    "auction": "int",
    "kind": "str",
    "price": "int",
    "reserve": "int",
    "expires": "int",
    "category": "int",
    "seller": "int",
}
# What a closed auction carries from the first stage into the second.
CLOSED_FIELDS: dict[str, FieldType] = {
    "auction": "int",
    "category": "int",
    "seller": "int",
    "price": "int",
    "expires": "int",
}


def is_auction_or_bid(record: Record) -> bool:
    return bool(record["kind"] in ("auction", "bid"))


def by_auction(record: Record) -> Record:
    auction = record["kind"] == "auction"
    fields = {field: record[field] for field in AUCTION_OR_BID_FIELDS if field != "auction"}
    return {"auction": record["id"] if auction else record["auction"], **fields}


def winning_bid(state: Record | None, record: Record, timers: Any) -> tuple[Record, None]:
    """Joins an auction with its bids, keeping the highest bid at or above the reserve whose
    event time lies in [the auction's, its `expires`]; a timer just after `expires` closes the
    auction (just after: a record at the watermark's time may still come). A bid that comes
    before its auction (disorder, another source instance) waits for it until the watermark
    passes the bid: an auction that has not come by then opened after the bid."""
    state = state or {"auction": None, "best": None, "early": []}
    at = int(record["event_time"])
    if record["kind"] == "auction":
        auction = {field: int(record[field]) for field in AUCTION_FIELDS} | {"at": at}
        best = None
        for price, bid_at in state["early"]:
            timers.delete_event_time_timer(bid_at + 1)
            best = _better(auction, best, price, bid_at)
        timers.register_event_time_timer(auction["expires"] + 1)
        return {"auction": auction, "best": best, "early": []}, None
    price = int(record["price"])
    if state["auction"] is None:
        timers.register_event_time_timer(at + 1)
        return {**state, "early": [*state["early"], [price, at]]}, None
    return {**state, "best": _better(state["auction"], state["best"], price, at)}, None


def _better(auction: Record, best: int | None, price: int, at: int) -> int | None:
    """The winning price so far with the bid (`price` at `at`) counted, if it qualifies."""
    if not auction["at"] <= at <= auction["expires"] or price < auction["reserve"]:
        return best
    return price if best is None or price > best else best


def close_auction(
    state: Record, key: int, timestamp: int, kind: str, timers: Any
) -> tuple[Record | None, list[int] | None]:
    """An auction closes with its winning price ([auction, category, seller, price, expires]);
    one without a qualifying bid closes with nothing. Bids that waited in vain are forgotten."""
    auction = state["auction"]
    if auction is not None:
        if state["best"] is None:
            return None, None
        closed = [key, auction["category"], auction["seller"], state["best"], auction["expires"]]
        return None, closed
    early = [[price, at] for price, at in state["early"] if at + 1 > timestamp]
    return ({**state, "early": early} if early else None), None


def closed(record: Record) -> Record:
    """A closed auction, from the first stage's output, as fields for the second."""
    return dict(zip(CLOSED_FIELDS, json.loads(record["value"]), strict=True))


def last_closed(state: Record | None, record: Record, timers: Any) -> tuple[Record, None]:
    """Q6, per seller: closed auctions wait for the watermark to pass them, so that those of
    other instances of the first stage closed at the same time are in too, and are then taken
    in the order of their closing (expires, auction id), as the SQL orders them."""
    state = state or {"last": [], "waiting": []}
    due = int(record["event_time"]) + 1
    timers.register_event_time_timer(due)
    waiting = [*state["waiting"], [record["expires"], record["auction"], record["price"], due]]
    return {**state, "waiting": waiting}, None


def average_last(
    state: Record, key: int, timestamp: int, kind: str, timers: Any
) -> tuple[Record, list[list[Any]] | None]:
    """Each closed auction now due, in closing order: [auction, the mean of the seller's last
    Q6_LAST closing prices, this one's included]."""
    due = sorted(w for w in state["waiting"] if w[3] <= timestamp)
    last = list(state["last"])
    rows = []
    for _, auction, price, _ in due:
        last = [*last, price][-Q6_LAST:]
        rows.append([auction, sum(last) / len(last)])
    waiting = [w for w in state["waiting"] if w[3] > timestamp]
    return {"last": last, "waiting": waiting}, rows or None
