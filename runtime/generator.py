"""The built-in generator source: deterministic keys and values by (seed, source, sequence),
paced by a load profile. Called by the source stage instances (keyshift.runtime.source_stage) and by
tests/benchmarks that compute the expected results independently.

Pure code: no clock reads (elapsed time is passed in) and no I/O.

- `rate_at` / `records_due`: a load profile's instantaneous rate and its exact integral.
- `InstanceShare` / `instance_total`: how a source stage of parallelism p splits the load.
- `KeyGenerator`: the records of one source, a pure function of the sequence number.
- `Pacer`: how many records an instance should emit by a given elapsed time.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import assert_never

import numpy as np
import numpy.typing as npt

from keyshift.runtime.job import (
    ConstantProfile,
    GeneratorSource,
    LoadProfile,
    PointsProfile,
    RampProfile,
    SineProfile,
    StepProfile,
)

__all__ = [
    "CHUNK",
    "MAX_WAIT_SECONDS",
    "ZIPF_HEAD_RANKS",
    "ZIPF_TABLE_MAX_KEYS",
    "InstanceShare",
    "KeyGenerator",
    "Pacer",
    "instance_total",
    "rate_at",
    "records_due",
]

KeyArray = npt.NDArray[np.int64]
ValueArray = npt.NDArray[np.float64]

CHUNK = 65536
"""Sequence numbers per random chunk; chunk c covers [c*CHUNK, (c+1)*CHUNK)."""

ZIPF_TABLE_MAX_KEYS = 20_000_000
"""Up to this many keys the zipf sampler uses an exact CDF table over all ranks."""

ZIPF_HEAD_RANKS = 1 << 20
"""Above ZIPF_TABLE_MAX_KEYS, the exact table covers this many top ranks; the tail is continuous."""

MAX_WAIT_SECONDS = 0.05
"""Upper bound of `Pacer.seconds_until_next`."""

# Tolerance when flooring the records due, so that e.g. 2.9999999999999996 counts as 3.
_DUE_REL_EPS = 1e-12
_DUE_ABS_EPS = 1e-9
# Below this |1 - s| the zipf tail uses the s == 1 (exp/log) form.
_ZIPF_S1_EPS = 1e-9
# Zipf ranks searched directly in a small (cache-resident) table; see _ZipfSampler.
_ZIPF_FAST_RANKS = 4096


# --------------------------------------------------------------------------------------------
# Load profiles


def rate_at(profile: LoadProfile | None, t: float) -> float | None:
    """Records per second at `t` seconds after start; None when the profile is unlimited.

    Times before the start (t < 0) are evaluated as t = 0.
    """
    if profile is None:
        return None
    t = max(t, 0.0)
    if isinstance(profile, ConstantProfile):
        return profile.rate
    if isinstance(profile, StepProfile):
        return profile.rate if t < profile.at else profile.to
    if isinstance(profile, RampProfile):
        if t >= profile.over:
            return profile.to
        return profile.rate + (profile.to - profile.rate) * (t / profile.over)
    if isinstance(profile, SineProfile):
        value = profile.rate + profile.amplitude * math.sin(2.0 * math.pi * t / profile.period)
        return max(value, 0.0)
    if isinstance(profile, PointsProfile):
        i = bisect.bisect_right(profile.points, t, key=lambda p: p[0]) - 1
        return 0.0 if i < 0 else profile.points[i][1]
    assert_never(profile)


def records_due(profile: LoadProfile | None, t: float) -> float | None:
    """The integral of the rate from 0 to `t` (records due by then, fractional); None if unlimited.

    Exact closed forms: piecewise-linear pieces for step/ramp/points, and
    rate*t + amplitude*period/(2*pi)*(1 - cos(2*pi*t/period)) for sine. 0 for t <= 0.
    """
    if profile is None:
        return None
    if t <= 0.0:
        return 0.0
    if isinstance(profile, ConstantProfile):
        return profile.rate * t
    if isinstance(profile, StepProfile):
        if t <= profile.at:
            return profile.rate * t
        return profile.rate * profile.at + profile.to * (t - profile.at)
    if isinstance(profile, RampProfile):
        if t < profile.over:
            return profile.rate * t + (profile.to - profile.rate) * t * t / (2.0 * profile.over)
        return (profile.rate + profile.to) * profile.over / 2.0 + profile.to * (t - profile.over)
    if isinstance(profile, SineProfile):
        omega = 2.0 * math.pi / profile.period
        wave = profile.amplitude / omega * (1.0 - math.cos(omega * t))
        return max(profile.rate * t + wave, 0.0)
    if isinstance(profile, PointsProfile):
        total = 0.0
        points = profile.points
        for i, (start, rate) in enumerate(points):
            if start >= t:
                break
            end = points[i + 1][0] if i + 1 < len(points) else math.inf
            total += rate * (min(end, t) - start)
        return total
    assert_never(profile)


# --------------------------------------------------------------------------------------------
# Splitting the load over the instances of a source stage


def instance_total(total: int | None, index: int, parallelism: int) -> int | None:
    """Instance `index` of `parallelism` emits total//p records, plus one if index < total % p.

    The instance totals sum to `total`. None (no total) stays None.
    """
    _check_instance(index, parallelism)
    if total is None:
        return None
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, parallelism)
    return base + (1 if index < extra else 0)


def _check_instance(index: int, parallelism: int) -> None:
    if parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {parallelism}")
    if not 0 <= index < parallelism:
        raise ValueError(f"instance index {index} is not in [0, {parallelism})")


@dataclass(frozen=True)
class InstanceShare:
    """Instance `index` of a source stage with `parallelism` instances: 1/p of the rate."""

    index: int
    parallelism: int

    def __post_init__(self) -> None:
        _check_instance(self.index, self.parallelism)

    @property
    def fraction(self) -> float:
        return 1.0 / self.parallelism

    def rate_at(self, profile: LoadProfile | None, t: float) -> float | None:
        rate = rate_at(profile, t)
        return None if rate is None else rate / self.parallelism

    def records_due(self, profile: LoadProfile | None, t: float) -> float | None:
        due = records_due(profile, t)
        return None if due is None else due / self.parallelism

    def total(self, total: int | None) -> int | None:
        return instance_total(total, self.index, self.parallelism)

    def pacer(self, profile: LoadProfile | None, total: int | None) -> Pacer:
        """A pacer for this instance, given the profile and the total of all instances."""
        return Pacer(profile, self.fraction, self.total(total))


# --------------------------------------------------------------------------------------------
# Deterministic keys and values


class _ZipfSampler:
    """Maps uniform u in [0, 1) to key = rank - 1 with P(rank k) proportional to 1/k**s.

    Ranks 1..head use an exact, normalized float64 CDF table `cdf`; the key is exactly
    `np.searchsorted(cdf, u, side="right")` (the number of entries <= u). When head < keys (more
    than ZIPF_TABLE_MAX_KEYS keys, whose table would be too large), u >= cdf[-1] falls in ranks
    head+1..keys, approximated by the continuous bounded Zipf density x**-s on
    [head + 0.5, keys + 0.5] (midpoint rule: rank k owns [k - 0.5, k + 0.5)), sampled by its
    inverse CDF and rounded to the nearest rank. The tail's total mass is that integral too; with
    head = 2**20 the per-rank relative error is about s*(s+1)/(24*k**2), 1e-12 or less. s == 1 (and
    |1 - s| < 1e-9) uses the exp/log form of the inverse.

    Speed: a searchsorted over a large table is cache-bound, so it runs only over the first
    `_ZIPF_FAST_RANKS` entries (which stay in cache); beyond them the same continuous inverse,
    anchored at that rank, estimates the position, which is then checked against the table
    (cdf[i - 1] <= u < cdf[i]) and, for the rare miss, looked up with a full searchsorted. The
    result is identical to the full searchsorted.
    """

    def __init__(self, keys: int, exponent: float, head: int) -> None:
        self.keys = keys
        self.head = min(keys, head)
        self.cdf, self.norm = _zipf_table(keys, exponent, self.head)
        self.fast = min(self.head, _ZIPF_FAST_RANKS)
        self.fast_cdf = self.cdf[: self.fast].copy()
        self.g = 1.0 - exponent
        self.g_is_zero = abs(self.g) < _ZIPF_S1_EPS

    def _continuous(self, u: ValueArray, rank: int, low: int, high: int) -> KeyArray:
        """Keys for u beyond cdf[rank - 1] by the continuous inverse anchored after `rank`,
        clipped to [low, high]."""
        # w: unnormalized mass below the sample, the integral of x**-s from a to x.
        w: ValueArray = np.maximum(u - self.cdf[rank - 1], 0.0) * self.norm
        a = rank + 0.5
        x: ValueArray
        if self.g_is_zero:
            x = a * np.exp(w)
        else:
            # x = (a**g + g*w)**(1/g) = a * (1 + g*w*a**-g)**(1/g), stable for small |g|.
            arg = np.maximum(self.g * math.pow(a, -self.g) * w, -1.0)
            with np.errstate(divide="ignore", over="ignore"):
                x = a * np.exp(np.log1p(arg) / self.g)
        key = np.clip(np.floor(x + 0.5) - 1.0, low, high)
        return key.astype(np.int64)

    def keys_for(self, u: ValueArray) -> KeyArray:
        idx = np.searchsorted(self.fast_cdf, u, side="right").astype(np.int64)
        if self.fast == self.keys:
            np.minimum(idx, self.keys - 1, out=idx)
            return idx
        rest = np.flatnonzero(idx >= self.fast)
        if rest.size == 0:
            return idx
        ur = u[rest]
        if self.head < self.keys:
            beyond = ur >= self.cdf[-1]
            if beyond.any():
                idx[rest[beyond]] = self._continuous(
                    ur[beyond], self.head, self.head, self.keys - 1
                )
                inside = ~beyond
                rest, ur = rest[inside], ur[inside]
        if rest.size:
            est = self._continuous(ur, self.fast, self.fast, self.head - 1)
            cdf = self.cdf
            miss = np.flatnonzero((cdf[est] <= ur) | (cdf[est - 1] > ur))
            if miss.size:
                est[miss] = np.searchsorted(cdf, ur[miss], side="right")
            np.minimum(est, self.keys - 1, out=est)
            idx[rest] = est
        return idx


@functools.lru_cache(maxsize=4)
def _zipf_table(keys: int, exponent: float, head: int) -> tuple[ValueArray, float]:
    """(normalized CDF of ranks 1..head, normalizer): shared between generators, read-only.

    The normalizer is the sum of k**-s over 1..head plus, when head < keys, the tail integral of
    x**-s over [head + 0.5, keys + 0.5]. The last entry is exactly 1.0 when head == keys.
    """
    cdf = np.arange(1, head + 1, dtype=np.float64)
    if exponent == 1.0:
        np.reciprocal(cdf, out=cdf)
    else:
        np.power(cdf, -exponent, out=cdf)
    np.cumsum(cdf, out=cdf)
    norm = float(cdf[-1]) + _zipf_tail_integral(keys, exponent, head)
    cdf /= norm
    if head == keys:
        cdf[-1] = 1.0
    cdf.flags.writeable = False
    return cdf, norm


def _zipf_tail_integral(keys: int, exponent: float, head: int) -> float:
    """The integral of x**-s over [head + 0.5, keys + 0.5] (0 when head == keys)."""
    if head >= keys:
        return 0.0
    a = head + 0.5
    log_ratio = math.log((keys + 0.5) / a)
    g = 1.0 - exponent
    if abs(g) < _ZIPF_S1_EPS:
        return log_ratio  # the s == 1 limit
    return math.pow(a, g) * math.expm1(g * log_ratio) / g


class KeyGenerator:
    """Keys and values of one generator source, a pure function of the sequence number.

    `records(start, n)` depends only on (config.seed, source_id, seq, config.keys,
    config.distribution, config.zipf_exponent), never on how the calls are split. Chunk c covers
    seqs [c*CHUNK, (c+1)*CHUNK) and draws, from `np.random.default_rng([seed, source_id, c])`,
    first `u = rng.random(CHUNK)` (keys) and then `rng.integers(0, 100, CHUNK)` (values, as
    float64: small integers, so float sums are exact). Keys: uniform `floor(u * keys)`; zipf
    `rank - 1` (key 0 is the most frequent), see `_ZipfSampler`; sequential `seq % keys` (each
    key once per `keys` records: state of a known size, built as fast as the job takes it).
    The last chunk is cached, so sequential calls are cheap.
    """

    def __init__(self, config: GeneratorSource, source_id: int) -> None:
        if source_id < 0:
            raise ValueError(f"source_id must be >= 0, got {source_id}")
        self.config = config
        self.source_id = source_id
        self._zipf: _ZipfSampler | None = None
        if config.distribution == "zipf":
            head = config.keys if config.keys <= ZIPF_TABLE_MAX_KEYS else ZIPF_HEAD_RANKS
            self._zipf = _ZipfSampler(config.keys, config.zipf_exponent, head)
        self._cached_chunk = -1
        self._cached: tuple[KeyArray, ValueArray] | None = None

    def records(self, start_seq: int, n: int) -> tuple[KeyArray, ValueArray]:
        """(keys int64[n], values float64[n]) of seqs start_seq .. start_seq + n - 1.

        The arrays are fresh (the caller may keep or modify them).
        """
        if start_seq < 0 or n < 0:
            raise ValueError(f"need start_seq >= 0 and n >= 0, got {start_seq}, {n}")
        keys = np.empty(n, dtype=np.int64)
        values = np.empty(n, dtype=np.float64)
        pos = 0
        seq = start_seq
        while pos < n:
            c, offset = divmod(seq, CHUNK)
            take = min(CHUNK - offset, n - pos)
            chunk_keys, chunk_values = self._chunk(c)
            keys[pos : pos + take] = chunk_keys[offset : offset + take]
            values[pos : pos + take] = chunk_values[offset : offset + take]
            pos += take
            seq += take
        return keys, values

    def _chunk(self, c: int) -> tuple[KeyArray, ValueArray]:
        if self._cached is not None and self._cached_chunk == c:
            return self._cached
        rng = np.random.default_rng([self.config.seed, self.source_id, c])
        u = rng.random(CHUNK)
        values = rng.integers(0, 100, CHUNK).astype(np.float64)
        if self._zipf is not None:
            keys = self._zipf.keys_for(u)
        elif self.config.distribution == "sequential":
            keys = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.int64) % self.config.keys
        else:
            n_keys = self.config.keys
            keys = (u * n_keys).astype(np.int64)
            np.minimum(keys, n_keys - 1, out=keys)
        self._cached_chunk = c
        self._cached = (keys, values)
        return self._cached


# --------------------------------------------------------------------------------------------
# Pacing


class Pacer:
    """How many records one instance should have emitted by an elapsed time.

    `share` is the instance's fraction of the stage's rate (1/p); `total` its own record budget
    (see `instance_total`) or None for no end. An unlimited profile (None) means as fast as
    possible, still bounded by `total`.
    """

    def __init__(self, profile: LoadProfile | None, share: float, total: int | None) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.profile = profile
        self.share = share
        self.total = total

    def rate(self, elapsed: float) -> float | None:
        """This instance's rate at `elapsed` seconds; None when unlimited."""
        rate = rate_at(self.profile, elapsed)
        return None if rate is None else rate * self.share

    def target(self, elapsed: float) -> int | None:
        """Records this instance should have emitted by `elapsed` (capped by total); None if
        unlimited and without total."""
        due = records_due(self.profile, elapsed)
        if due is None:
            return self.total
        x = due * self.share
        count = math.floor(x * (1.0 + _DUE_REL_EPS) + _DUE_ABS_EPS)
        return count if self.total is None else min(count, self.total)

    def due(self, elapsed: float, emitted: int) -> int | None:
        """Records to emit now (>= 0, capped by the remaining total); None = unlimited."""
        target = self.target(elapsed)
        if target is None:
            return None
        return max(target - emitted, 0)

    def arrival(self, count: int, elapsed: float) -> float:
        """The elapsed time at which the `count`-th record fell due: when it arrived, as a
        record appended to a log would have. A source that is backpressured or paused emits it
        later, and its latency must include that wait. Without a rate it is `elapsed`."""
        if records_due(self.profile, elapsed) is None or (self.target(elapsed) or 0) < count:
            return elapsed
        return self._first_due(count, elapsed, steps=40)

    def _first_due(self, count: int, hi: float, steps: int) -> float:
        """The earliest elapsed time in [0, hi] by which `count` records fell due, bisected;
        `target(hi)` must reach `count`."""
        lo = 0.0
        for _ in range(steps):
            mid = (lo + hi) / 2.0
            if (self.target(mid) or 0) >= count:
                hi = mid
            else:
                lo = mid
        return hi

    def elapsed_at(self, count: int) -> float:
        """The elapsed time by which `count` records fell due (0 without a rate): where a
        source that resumes at record `count` picks up its profile."""
        if count <= 0 or records_due(self.profile, 1.0) is None:
            return 0.0
        hi = 1.0
        while (self.target(hi) or 0) < count:
            if hi > 1e9:
                return hi  # the profile never gets there (a rate of 0 from some point on)
            hi *= 2.0
        return self._first_due(count, hi, steps=60)

    def done(self, emitted: int) -> bool:
        """Whether the total is reached (never, without a total)."""
        return self.total is not None and emitted >= self.total

    def seconds_until_next(self, elapsed: float, emitted: int) -> float:
        """A wait hint in [0, MAX_WAIT_SECONDS] until the next record is due.

        0 when something is due now (or unlimited); MAX_WAIT_SECONDS when nothing becomes due
        within that bound (rate-0 phases, or done). Otherwise the bisected time at which the
        next record falls due, so a caller waking then finds at least one record due.
        """
        due = self.due(elapsed, emitted)
        if due is None or due > 0:
            return 0.0
        if self.done(emitted):
            return MAX_WAIT_SECONDS
        hi = elapsed + MAX_WAIT_SECONDS
        if not self.due(hi, emitted):
            return MAX_WAIT_SECONDS
        lo = elapsed
        for _ in range(16):  # 0.05 s / 2**16 < 1 microsecond
            mid = (lo + hi) / 2.0
            if self.due(mid, emitted):
                hi = mid
            else:
                lo = mid
        return min(max(hi - elapsed, 0.0), MAX_WAIT_SECONDS)
