"""NEXMark's event model (Person, Auction and Bid events of an online auction) as a pure,
vectorised generator. Called by the source stage for sources of `kind: nexmark`
(`keyshift.runtime.source_stage`), by the PySpark source `format("keyshift-nexmark")`
(`keyshift.spark.nexmark`) and by the tests' reference engine, which writes the same events to
Parquet for DuckDB.

The model is the one of Beam's and Flink's NEXMark generators: out of every 50 events, 1 is a
new person, 3 are new auctions and 46 are bids; event number `e` is a person when `e % 50 == 0`,
an auction when `1 <= e % 50 <= 3`, else a bid. Ids start at 1000. An auction's seller is a hot
seller (the first of the last 100 people) with probability 1 - 1/hot_seller_ratio, else one of
the `active_people` latest people (or a few not yet created); a bid's auction is a hot auction
(the first of the last 100 auctions) with probability 1 - 1/hot_auction_ratio, else one of the
`in_flight_auctions` latest; its bidder a hot bidder likewise. Prices are 100 * 10**(6u) cents
rounded. Event time advances by 1/event_rate seconds per event from `start_time_us`; with
`max_disorder_us`, each event is earlier than that by up to that bound (uniformly), so a
bounded-out-of-orderness watermark of that bound never makes a generated event late.

Every value is a pure function of (seed, event number): a counter-based hash (splitmix64, as
keys are hashed in `keyshift.runtime.keyspace`) per event and per random stream, so any slice
of the event numbers is generated alone, in any order, by any number of instances. Instance `i`
of `p` generates event numbers `i, i + p, i + 2p, ...`: the union over the instances is the same
stream whatever `p` is.

One schema carries the three kinds (`FIELDS`): a `kind` column ("person", "auction", "bid") and
the fields of each kind; a field that does not belong to a record's kind is 0 or "" (the
runtime's schemas have no nulls). `id` is a person's or an auction's id (0 for a bid). Strings
come from small fixed vocabularies (names, cities and states as Beam's), built as Arrow
dictionary arrays, so no Python runs per event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from keyshift.runtime.job_graph import FieldType
from keyshift.runtime.keyspace import hash_keys
from keyshift.runtime.records import EVENT_TIME

__all__ = [
    "FIELDS",
    "KINDS",
    "START_TIME_US",
    "NexmarkModel",
    "event_kinds",
    "event_numbers",
    "event_times",
    "events",
]

Ints = npt.NDArray[np.int64]

PERSON, AUCTION, BID = "person", "auction", "bid"
KINDS: Final = (PERSON, AUCTION, BID)
PERSON_PROPORTION, AUCTION_PROPORTION, BID_PROPORTION = 1, 3, 46
PROPORTION_DENOMINATOR = PERSON_PROPORTION + AUCTION_PROPORTION + BID_PROPORTION
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
HOT_RATIO = 100  # hot sellers, bidders and auctions are the first of each batch of 100
ID_LEAD = 10  # ids of people and auctions not created yet that may be drawn
START_TIME_US: Final = 1_704_067_200_000_000  # 2024-01-01T00:00:00Z: event times are fixed

FIELDS: Final[dict[str, FieldType]] = {
    "kind": "str",
    "id": "int",
    "name": "str",
    "email": "str",
    "city": "str",
    "state": "str",
    "item_name": "str",
    "initial_bid": "int",
    "reserve": "int",
    "expires": "int",
    "seller": "int",
    "category": "int",
    "auction": "int",
    "bidder": "int",
    "price": "int",
}
"""The schema of every NEXMark record (before the metadata every record carries)."""

_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
_CITIES = (
    "Phoenix",
    "Los Angeles",
    "San Francisco",
    "Boise",
    "Portland",
    "Bend",
    "Redmond",
    "Seattle",
    "Kent",
    "Cheyenne",
)
_FIRST = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter")
_LAST = ("Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris")
_NAMES = tuple(f"{first} {last}" for first in _FIRST for last in _LAST)
_DOMAINS = ("example.com", "example.org", "example.net", "mail.test")
_EMAILS = tuple(
    f"{first.lower()}.{last.lower()}@{domain}"
    for first in _FIRST
    for last in _LAST
    for domain in _DOMAINS
)
_ITEMS = 1000


def _item_names() -> tuple[str, ...]:
    """A fixed vocabulary of item names (the same in every process and run)."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    draws = np.random.default_rng(20_240_101).integers(0, 26, size=(_ITEMS, 8))
    return tuple("".join(row) for row in letters[draws])


def _vocabulary(words: tuple[str, ...]) -> pa.Array:
    """Index 0 is "" (the field does not belong to the record's kind)."""
    return pa.array(("", *words), type=pa.string())


_VOCABULARIES: Final = {
    "kind": _vocabulary(KINDS),
    "name": _vocabulary(_NAMES),
    "email": _vocabulary(_EMAILS),
    "city": _vocabulary(_CITIES),
    "state": _vocabulary(_STATES),
    "item_name": _vocabulary(_item_names()),
}

# One random stream per drawn quantity: event e's draw of stream s is hash(e * 16 + s).
(
    _S_SELLER_HOT,
    _S_SELLER,
    _S_CATEGORY,
    _S_INITIAL,
    _S_RESERVE,
    _S_EXPIRES,
    _S_AUCTION_HOT,
    _S_AUCTION,
    _S_BIDDER_HOT,
    _S_BIDDER,
    _S_PRICE,
    _S_NAME,
    _S_EMAIL,
    _S_CITY,
    _S_STATE,
    _S_DISORDER,
) = range(16)
_STREAMS = 16


@dataclass(frozen=True)
class NexmarkModel:
    """The generator's parameters; Beam's defaults."""

    seed: int = 0
    event_rate: float = 10_000.0
    start_time_us: int = START_TIME_US
    max_disorder_us: int = 0
    hot_auction_ratio: int = 2
    hot_seller_ratio: int = 4
    hot_bidder_ratio: int = 4
    active_people: int = 1000
    in_flight_auctions: int = 100

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.event_rate > 0:
            raise ValueError(f"event_rate must be > 0 events per second, got {self.event_rate}")
        if self.max_disorder_us < 0:
            raise ValueError(f"max_disorder_us must be >= 0, got {self.max_disorder_us}")
        for name in ("hot_auction_ratio", "hot_seller_ratio", "hot_bidder_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.active_people < 1 or self.in_flight_auctions < 1:
            raise ValueError("active_people and in_flight_auctions must be >= 1")


def event_numbers(index: int, parallelism: int, start: int, count: int) -> Ints:
    """The event numbers of records start .. start + count - 1 of instance `index` of
    `parallelism`: every `parallelism`-th event, from `index` on."""
    if not 0 <= index < parallelism:
        raise ValueError(f"instance index {index} is not in [0, {parallelism})")
    if start < 0 or count < 0:
        raise ValueError(f"need start >= 0 and count >= 0, got {start}, {count}")
    return np.arange(start, start + count, dtype=np.int64) * parallelism + index


class _Draws:
    """Uniform draws in [0, 1) of the events `numbers`, one independent stream each."""

    def __init__(self, seed: int, numbers: Ints) -> None:
        self.base = numbers * _STREAMS
        self.salt = np.int64(hash_keys(np.array([seed], dtype=np.int64)).view(np.int64)[0])

    def uniform(self, stream: int) -> npt.NDArray[np.float64]:
        mixed = hash_keys(hash_keys(self.base + stream).view(np.int64) ^ self.salt)
        return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def below(self, stream: int, bound: Ints | int) -> Ints:
        """Integers uniform in [0, bound)."""
        return np.minimum(
            (self.uniform(stream) * bound).astype(np.int64), np.asarray(bound, np.int64) - 1
        )


def _last_person(numbers: Ints) -> Ints:
    """The last person id created by event e (base 0): the current one for a person."""
    return numbers // PROPORTION_DENOMINATOR


def _last_auction(numbers: Ints) -> Ints:
    """The last auction id created by event e (base 0): the current one for an auction."""
    epoch, offset = np.divmod(numbers, PROPORTION_DENOMINATOR)
    person = offset < PERSON_PROPORTION
    bid = offset >= PERSON_PROPORTION + AUCTION_PROPORTION
    epoch = np.where(person, epoch - 1, epoch)
    offset = np.where(person | bid, AUCTION_PROPORTION - 1, offset - PERSON_PROPORTION)
    return epoch * AUCTION_PROPORTION + offset


def _next_person(model: NexmarkModel, numbers: Ints, draws: _Draws, stream: int) -> Ints:
    """A random person among the active ones, or one of the next few (base 0)."""
    people = _last_person(numbers) + 1
    active = np.minimum(people, model.active_people)
    return people - active + draws.below(stream, active + ID_LEAD)


def _next_auction(model: NexmarkModel, numbers: Ints, draws: _Draws, stream: int) -> Ints:
    """A random auction among those likely still open, or one of the next few (base 0)."""
    last = _last_auction(numbers)
    low = np.maximum(last - model.in_flight_auctions, 0)
    return low + draws.below(stream, last - low + 1 + ID_LEAD)


def _pick_hot(hot: Ints, other: Ints, ratio: int, draws: _Draws, stream: int) -> Ints:
    """`hot` with probability 1 - 1/ratio, else `other`."""
    return np.where(draws.below(stream, ratio) > 0, hot, other)


def _price(draws: _Draws, stream: int) -> Ints:
    return np.rint(np.power(10.0, draws.uniform(stream) * 6.0) * 100.0).astype(np.int64)


def _strings(field: str, indices: Ints, mask: npt.NDArray[np.bool_]) -> pa.Array:
    """A string column from vocabulary indices (1-based), "" where `mask` is false."""
    codes = np.where(mask, indices + 1, 0).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(codes), _VOCABULARIES[field]).cast(pa.string())


def event_kinds(numbers: Ints) -> Ints:
    """0 (person), 1 (auction) or 2 (bid) of each event number."""
    offset = numbers % PROPORTION_DENOMINATOR
    return np.where(
        offset < PERSON_PROPORTION,
        0,
        np.where(offset < PERSON_PROPORTION + AUCTION_PROPORTION, 1, 2),
    ).astype(np.int64)


def event_times(model: NexmarkModel, numbers: Ints) -> Ints:
    """Each event's time (epoch µs): its place in the stream, less its disorder."""
    delay_us = 1e6 / model.event_rate
    nominal = model.start_time_us + (numbers * delay_us).astype(np.int64)
    if model.max_disorder_us == 0:
        return nominal
    draws = _Draws(model.seed, numbers)
    return nominal - draws.below(_S_DISORDER, model.max_disorder_us + 1)


def events(model: NexmarkModel, numbers: Ints) -> pa.RecordBatch:
    """The events `numbers` (any int64 array of event numbers >= 0): `FIELDS` and their event
    time (`records.EVENT_TIME`, epoch µs), in the order given."""
    numbers = np.ascontiguousarray(numbers, dtype=np.int64)
    if numbers.size and int(numbers.min()) < 0:
        raise ValueError("event numbers must be >= 0")
    draws = _Draws(model.seed, numbers)
    kind = event_kinds(numbers)
    person, auction, bid = kind == 0, kind == 1, kind == 2
    zero = np.zeros(numbers.size, dtype=np.int64)
    times = event_times(model, numbers)
    last_person = _last_person(numbers)
    last_auction = _last_auction(numbers)

    seller = FIRST_PERSON_ID + _pick_hot(
        (last_person // HOT_RATIO) * HOT_RATIO,
        _next_person(model, numbers, draws, _S_SELLER),
        model.hot_seller_ratio,
        draws,
        _S_SELLER_HOT,
    )
    initial = _price(draws, _S_INITIAL)
    # An auction lasts, on average, as long as the next `in_flight_auctions` auctions take to
    # be created (Beam's horizon); 1 µs at least.
    horizon_us = model.in_flight_auctions * PROPORTION_DENOMINATOR / AUCTION_PROPORTION
    horizon_us *= 1e6 / model.event_rate
    length = 1 + (draws.uniform(_S_EXPIRES) * 2.0 * horizon_us).astype(np.int64)
    bid_auction = FIRST_AUCTION_ID + _pick_hot(
        (last_auction // HOT_RATIO) * HOT_RATIO,
        _next_auction(model, numbers, draws, _S_AUCTION),
        model.hot_auction_ratio,
        draws,
        _S_AUCTION_HOT,
    )
    # Hot bidders are the second of their batch, so hot bidders and hot sellers differ.
    bidder = FIRST_PERSON_ID + _pick_hot(
        (last_person // HOT_RATIO) * HOT_RATIO + 1,
        _next_person(model, numbers, draws, _S_BIDDER),
        model.hot_bidder_ratio,
        draws,
        _S_BIDDER_HOT,
    )
    ids = np.where(
        person,
        FIRST_PERSON_ID + last_person,
        np.where(auction, FIRST_AUCTION_ID + last_auction, 0),
    )
    columns = {
        "kind": _strings("kind", kind, np.ones(numbers.size, dtype=bool)),
        "id": ids,
        "name": _strings("name", draws.below(_S_NAME, len(_NAMES)), person),
        "email": _strings("email", draws.below(_S_EMAIL, len(_EMAILS)), person),
        "city": _strings("city", draws.below(_S_CITY, len(_CITIES)), person),
        "state": _strings("state", draws.below(_S_STATE, len(_STATES)), person),
        "item_name": _strings("item_name", draws.below(_S_NAME, _ITEMS), auction),
        "initial_bid": np.where(auction, initial, zero),
        "reserve": np.where(auction, initial + _price(draws, _S_RESERVE), zero),
        "expires": np.where(auction, times + length, zero),
        "seller": np.where(auction, seller, zero),
        "category": np.where(
            auction, FIRST_CATEGORY_ID + draws.below(_S_CATEGORY, NUM_CATEGORIES), zero
        ),
        "auction": np.where(bid, bid_auction, zero),
        "bidder": np.where(bid, bidder, zero),
        "price": np.where(bid, _price(draws, _S_PRICE), zero),
    }
    arrays = [pa.array(columns[name]) for name in FIELDS]
    return pa.RecordBatch.from_arrays([*arrays, pa.array(times)], names=[*FIELDS, EVENT_TIME])
