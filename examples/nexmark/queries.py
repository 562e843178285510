"""The functions of the NEXMark query jobs in examples/nexmark/ (q0.yaml ... q8.yaml): filters
and maps chained in the source, process functions in keyed stages, and the reduce functions of
Q5's and Q7's event-time windows, each window's answer sent once when it fires, and the pair
functions of the joins (Q8's window join, early_bids.yaml's interval join).
tests/test_nexmark_queries.py runs each job and compares its answers with DuckDB's
(examples/nexmark/sql/).
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]
WINDOW_US = 10_000_000  # Q7 and Q8: tumbling windows of 10 s of event time
Q2_AUCTIONS = 123  # Q2 keeps the bids of every 123rd auction
Q3_STATES = ("OR", "ID", "CA")
Q3_CATEGORY = 10
EUROS_PER_100_DOLLARS = 89


def window_start(record: Record) -> int:
    return int(record["event_time"]) // WINDOW_US * WINDOW_US


def is_bid(record: Record) -> bool:
    return bool(record["kind"] == "bid")


def q0(state: Any, record: Record) -> tuple[None, Record]:
    """Pass-through: each bid as it came (no state kept)."""
    return None, {"bidder": record["bidder"], "price": record["price"]}


def q1(state: Any, record: Record) -> tuple[None, Record]:
    """Currency conversion: each bid's price in euros."""
    euros = record["price"] * EUROS_PER_100_DOLLARS // 100
    return None, {"bidder": record["bidder"], "price": euros}


def is_q2_bid(record: Record) -> bool:
    return is_bid(record) and record["auction"] % Q2_AUCTIONS == 0


def q2(state: Any, record: Record) -> tuple[None, int]:
    """Selection: the price of a bid on a selected auction (the key is the auction)."""
    return None, int(record["price"])


def is_q3_input(record: Record) -> bool:
    """People of the states Q3 asks about, and auctions of its category."""
    if record["kind"] == "person":
        return record["state"] in Q3_STATES
    return bool(record["kind"] == "auction" and record["category"] == Q3_CATEGORY)


def q3_by_person(record: Record) -> Record:
    """Key people by their id and auctions by their seller."""
    person = record["kind"] == "person"
    return {
        "person": record["id"] if person else record["seller"],
        "auction": 0 if person else record["id"],
        "name": record["name"],
        "city": record["city"],
        "state": record["state"],
    }


def q3(state: Record | None, record: Record) -> tuple[Record, list[list[Any]] | None]:
    """An incremental join: a person's auctions wait for the person (an auction may name a
    seller who has not registered yet); each match is emitted once."""
    state = state or {"who": None, "waiting": []}
    if record["auction"] == 0:
        who = [record["name"], record["city"], record["state"]]
        matches = [[*who, auction] for auction in state["waiting"]]
        return {"who": who, "waiting": []}, matches or None
    if state["who"] is None:
        return {"who": None, "waiting": [*state["waiting"], record["auction"]]}, None
    return state, [[*state["who"], record["auction"]]]


Q3_TTL_US = 10_000_000  # q3_ttl: a person and a waiting auction are kept 10 s of event time


def q3_ttl(state: Record | None, record: Record, timers: Any) -> tuple[Any, Any]:
    """Q3 as a regular join with a state TTL (q3_ttl.yaml): a person and an auction match when
    their event times are less than Q3_TTL_US apart; each side's state expires by an
    event-time timer at its time + Q3_TTL_US, so neither side is kept for ever. (Comparing the
    times too makes the answer independent of when the timers fire.)"""
    state = state or {"who": None, "at": 0, "waiting": []}
    at = int(record["event_time"])
    if record["auction"] == 0:
        who = [record["name"], record["city"], record["state"]]
        matches = [[*who, a] for a, t in state["waiting"] if abs(at - t) < Q3_TTL_US]
        for _, t in state["waiting"]:
            timers.delete_event_time_timer(t + Q3_TTL_US)  # nothing waits any more
        timers.register_event_time_timer(at + Q3_TTL_US)
        return {"who": who, "at": at, "waiting": []}, matches or None
    if state["who"] is None:
        timers.register_event_time_timer(at + Q3_TTL_US)
        return {**state, "waiting": [*state["waiting"], [record["auction"], at]]}, None
    if abs(at - state["at"]) >= Q3_TTL_US:
        return state, None
    return state, [[*state["who"], record["auction"]]]


def q3_expire(
    state: Record, key: int, timestamp: int, kind: str, timers: Any
) -> tuple[Record | None, None]:
    """A person, or auctions waiting for one, whose time to live ended: forgotten."""
    who = state["who"] if state["at"] + Q3_TTL_US > timestamp else None
    waiting = [[a, t] for a, t in state["waiting"] if t + Q3_TTL_US > timestamp]
    if who is None and not waiting:
        return None, None
    return {"who": who, "at": state["at"] if who else 0, "waiting": waiting}, None


def q5_hottest(top: list[Any] | None, count: Record) -> list[Any]:
    """Q5's second window: over one sliding window's bid counts (one record per auction), the
    highest count and the auctions that have it."""
    num, auction = count["value"], count["key"]
    if top is None or num > top[0]:
        return [num, [auction]]
    if num == top[0]:
        top[1].append(auction)
    return top


def q7_by_window(record: Record) -> Record:
    """Q7's key: the 10 s tumbling window a bid falls in, so windows spread over key groups."""
    return {"window": window_start(record), "auction": record["auction"],
            "bidder": record["bidder"], "price": record["price"]}  # fmt: skip


def q7_highest(top: list[Any] | None, bid: Record) -> list[Any]:
    """Highest bid per window: the best price so far and the bids that offered it."""
    row = [bid["auction"], bid["bidder"], bid["price"], bid["event_time"]]
    if top is None or bid["price"] > top[0]:
        return [bid["price"], [row]]
    if bid["price"] == top[0]:
        top[1].append(row)
    return top


def is_person(record: Record) -> bool:
    return bool(record["kind"] == "person")


def is_auction(record: Record) -> bool:
    return bool(record["kind"] == "auction")


def q8(person: Record, auction: Record) -> list[Any]:
    """A new user who opened an auction in the window they registered in (the window join
    matched them): the person, the window, and the auction."""
    return [person["id"], person["name"], window_start(person), auction["id"]]


def early_bid(auction: Record, bid: Record) -> list[Any]:
    """A bid made within 2 s of its auction's opening (early_bids.yaml's interval join matched
    them): the auction, the bidder, the price and how long after the opening, µs."""
    return [auction["id"], bid["bidder"], bid["price"], bid["event_time"] - auction["event_time"]]
