"""Tests of keyshift.runtime.generator: deterministic data, profiles, instance split, pacing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from keyshift.runtime import generator as gen
from keyshift.runtime.generator import (
    CHUNK,
    MAX_WAIT_SECONDS,
    InstanceShare,
    KeyGenerator,
    Pacer,
    instance_total,
    rate_at,
    records_due,
)
from keyshift.runtime.job import (
    ConstantProfile,
    GeneratorSource,
    LoadProfile,
    PointsProfile,
    RampProfile,
    SineProfile,
    StepProfile,
)

EULER_GAMMA = 0.5772156649015329


def harmonic(n: int, s: float = 1.0) -> float:
    return float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** -s))


def zipf_gen(keys: int, s: float = 1.0, seed: int = 0, source: int = 0) -> KeyGenerator:
    config = GeneratorSource(keys=keys, distribution="zipf", zipf_exponent=s, seed=seed)
    return KeyGenerator(config, source)


def uniform_gen(keys: int, seed: int = 0, source: int = 0) -> KeyGenerator:
    return KeyGenerator(GeneratorSource(keys=keys, distribution="uniform", seed=seed), source)


# ------------------------------------------------------------------------------------------
# Deterministic data


@pytest.mark.parametrize("make", [lambda: uniform_gen(1000, seed=3), lambda: zipf_gen(50_000)])
def test_records_are_deterministic_and_split_independent(make: object) -> None:
    assert callable(make)
    n = 2 * CHUNK + 1234
    keys, values = make().records(0, n)
    assert keys.dtype == np.int64 and values.dtype == np.float64
    assert keys.shape == values.shape == (n,)

    again_keys, again_values = make().records(0, n)
    assert np.array_equal(keys, again_keys) and np.array_equal(values, again_values)

    # Uneven pieces crossing chunk boundaries, all from one generator (exercises the cache).
    g = make()
    cuts = [0, 10, 8192, CHUNK - 5, CHUNK + 7, 2 * CHUNK, n]
    parts = [g.records(a, b - a) for a, b in itertools.pairwise(cuts)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), keys)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), values)

    # Out of order and overlapping calls.
    assert np.array_equal(g.records(5, 3)[0], keys[5:8])
    assert np.array_equal(g.records(CHUNK + 100, 50)[1], values[CHUNK + 100 : CHUNK + 150])
    k0, v0 = g.records(0, 10)
    assert np.array_equal(k0, keys[:10]) and np.array_equal(v0, values[:10])
    assert g.records(123, 0)[0].shape == (0,)


def test_returned_arrays_are_fresh() -> None:
    g = uniform_gen(100)
    keys, values = g.records(0, 100)
    expected = keys.copy()
    keys[:] = -1
    values[:] = -1.0
    again, again_values = g.records(0, 100)
    assert np.array_equal(again, expected)
    assert (again_values >= 0).all()


def test_records_match_the_documented_chunk_recipe() -> None:
    """An independent reimplementation of the spec: rng per chunk, u for keys, ints for values."""
    keys_n, s, seed, source = 3000, 1.2, 11, 4
    start, n = 3 * CHUNK - 100, 300
    keys, values = zipf_gen(keys_n, s, seed, source).records(start, n)

    weights = np.arange(1, keys_n + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(weights) / weights.sum()
    exp_keys, exp_values = [], []
    for c in (2, 3):
        rng = np.random.default_rng([seed, source, c])
        u = rng.random(CHUNK)
        v = rng.integers(0, 100, CHUNK).astype(np.float64)
        exp_keys.append(np.minimum(np.searchsorted(cdf, u, side="right"), keys_n - 1))
        exp_values.append(v)
    all_keys = np.concatenate(exp_keys)
    all_values = np.concatenate(exp_values)
    offset = start - 2 * CHUNK
    assert np.array_equal(values, all_values[offset : offset + n])
    # The CDF is rounded differently here, so allow a disagreement exactly at a boundary.
    assert (keys == all_keys[offset : offset + n]).mean() > 0.999

    rng = np.random.default_rng([7, 1, 0])
    u = rng.random(CHUNK)
    uni_keys, _ = uniform_gen(500, seed=7, source=1).records(0, CHUNK)
    assert np.array_equal(uni_keys, (u * 500).astype(np.int64))


def test_zipf_keys_equal_full_searchsorted() -> None:
    """The fast path (small table + continuous estimate + check) equals a full searchsorted."""
    u = np.random.default_rng(1).random(200_000)
    u[:2] = [0.0, np.nextafter(1.0, 0.0)]
    for keys in (1, 3, 4096, 4097, 30_000, 300_000):
        for s in (0.3, 1.0, 1.0 + 1e-12, 1.7, 4.0):
            sampler = gen._ZipfSampler(keys, s, keys)
            want = np.minimum(np.searchsorted(sampler.cdf, u, side="right"), keys - 1)
            assert np.array_equal(sampler.keys_for(u), want), (keys, s)


def test_seeds_and_sources_differ() -> None:
    base = uniform_gen(1_000_000, seed=1, source=0).records(0, 1000)
    other_seed = uniform_gen(1_000_000, seed=2, source=0).records(0, 1000)
    other_source = uniform_gen(1_000_000, seed=1, source=1).records(0, 1000)
    for other in (other_seed, other_source):
        assert (base[0] != other[0]).mean() > 0.99
        assert (base[1] != other[1]).mean() > 0.9
    later = uniform_gen(1_000_000, seed=1, source=0).records(CHUNK, 1000)
    assert (base[0] != later[0]).mean() > 0.99


@pytest.mark.parametrize("distribution", ["uniform", "zipf", "sequential"])
@pytest.mark.parametrize("keys", [1, 2, 7, 5000, 1 << 40])
def test_keys_and_values_in_range(distribution: str, keys: int) -> None:
    config = GeneratorSource(keys=keys, distribution=distribution, seed=5)  # type: ignore[arg-type]
    k, v = KeyGenerator(config, 2).records(CHUNK - 1000, 20_000)
    assert k.min() >= 0 and k.max() <= keys - 1
    assert v.min() >= 0 and v.max() <= 99 and np.array_equal(v, np.floor(v))
    if keys == 1:
        assert (k == 0).all()
    if keys == 5000:
        assert len(np.unique(k)) > 1000


def test_sequential_keys_touch_each_key_once_per_round() -> None:
    config = GeneratorSource(keys=100_000, distribution="sequential", seed=3)
    generator = KeyGenerator(config, 0)
    keys, _ = generator.records(0, 100_000)
    assert np.array_equal(keys, np.arange(100_000))
    # Split anywhere, across chunks and rounds, the same keys.
    again = np.concatenate([generator.records(s, 50_000)[0] for s in (150_000, 200_000)])
    assert np.array_equal(again, np.arange(150_000, 250_000) % 100_000)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        KeyGenerator(GeneratorSource(), -1)
    with pytest.raises(ValueError):
        uniform_gen(10).records(-1, 5)
    with pytest.raises(ValueError):
        uniform_gen(10).records(0, -5)


# ------------------------------------------------------------------------------------------
# Distributions


def test_zipf_is_skewed_like_one_over_rank() -> None:
    n_keys, n = 1000, 4 * CHUNK
    keys, _ = zipf_gen(n_keys, 1.0, seed=9).records(0, n)
    freq = np.bincount(keys, minlength=n_keys) / n
    h = harmonic(n_keys)
    assert freq[0] == pytest.approx(1 / h, abs=0.005)
    assert freq[1] == pytest.approx(1 / (2 * h), abs=0.004)
    assert freq[9] == pytest.approx(1 / (10 * h), abs=0.002)
    assert freq[:10].sum() == pytest.approx(harmonic(10) / h, abs=0.01)
    assert freq[0] > 5 * freq[9] > 5 * 5 * freq[999]


def test_zipf_steeper_exponent_concentrates() -> None:
    keys, _ = zipf_gen(1000, 2.0).records(0, CHUNK)
    freq0 = (keys == 0).mean()
    assert freq0 == pytest.approx(1 / harmonic(1000, 2.0), abs=0.01)  # about 0.61


def test_uniform_is_flat() -> None:
    n_keys, n = 100, 4 * CHUNK
    keys, _ = uniform_gen(n_keys, seed=4).records(0, n)
    counts = np.bincount(keys, minlength=n_keys)
    expected = n / n_keys
    assert np.abs(counts - expected).max() < 0.1 * expected


def test_zipf_continuous_tail_approximates_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the table limit the tail is continuous; compare with the exact table."""
    n_keys = 200_000
    exact, _ = zipf_gen(n_keys, 0.8).records(0, 2 * CHUNK)
    monkeypatch.setattr(gen, "ZIPF_TABLE_MAX_KEYS", 50_000)
    monkeypatch.setattr(gen, "ZIPF_HEAD_RANKS", 1000)
    approx_gen = zipf_gen(n_keys, 0.8)
    assert approx_gen._zipf is not None and approx_gen._zipf.head == 1000
    approx, _ = approx_gen.records(0, 2 * CHUNK)
    assert approx.min() >= 0 and approx.max() <= n_keys - 1
    # Same u, nearly the same keys (off by at most one rank where they differ).
    assert (approx != exact).mean() < 1e-3
    assert np.abs(approx - exact).max() <= 1


@pytest.mark.parametrize("s", [1.0, 0.6, 1.4])
def test_zipf_huge_key_space(s: float) -> None:
    n_keys = 1 << 40
    keys, _ = zipf_gen(n_keys, s, seed=2).records(0, 2 * CHUNK)
    assert keys.min() >= 0 and keys.max() <= n_keys - 1
    if s == 1.0:
        h = math.log(n_keys) + EULER_GAMMA + 1 / (2 * n_keys)
    else:  # head exactly, tail by the integral (accurate for large head)
        head = 100_000
        a, b = head + 0.5, n_keys + 0.5
        h = harmonic(head, s) + (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    assert (keys == 0).mean() == pytest.approx(1 / h, abs=0.004)
    # A key beyond the exact head appears when the tail carries real mass.
    if s <= 1.0:
        assert (keys >= gen.ZIPF_HEAD_RANKS).mean() > 0.3


# ------------------------------------------------------------------------------------------
# Load profiles

PROFILES: list[LoadProfile] = [
    ConstantProfile(rate=250.0),
    StepProfile(kind="step", rate=100.0, to=400.0, at=3.0),
    StepProfile(kind="step", rate=300.0, to=0.0, at=2.5),
    RampProfile(kind="ramp", rate=50.0, to=500.0, over=4.0),
    RampProfile(kind="ramp", rate=500.0, to=0.0, over=2.0),
    SineProfile(kind="sine", rate=200.0, amplitude=150.0, period=3.0),
    SineProfile(kind="sine", rate=100.0, amplitude=100.0, period=0.7),
    PointsProfile(kind="points", points=[(0.5, 100.0), (2.0, 0.0), (3.0, 600.0), (6.5, 20.0)]),
    PointsProfile(kind="points", points=[(0.0, 80.0)]),
]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.kind)
def test_records_due_is_integral_of_rate(profile: LoadProfile) -> None:
    dt = 1e-3
    ts = np.arange(0.0, 10.0 + dt / 2, dt)
    rates = np.array([rate_at(profile, float(t)) for t in ts])
    assert (rates >= 0).all()
    cumulative = np.concatenate([[0.0], np.cumsum((rates[1:] + rates[:-1]) / 2 * dt)])
    dues = np.array([records_due(profile, float(t)) for t in ts])
    # A jump costs a trapezoid error of at most jump * dt / 2 each.
    assert np.abs(dues - cumulative).max() < 2.0
    assert np.all(np.diff(dues) >= -1e-9)
    assert records_due(profile, 0.0) == 0.0
    assert records_due(profile, -1.0) == 0.0


def test_profile_rates() -> None:
    assert rate_at(None, 5.0) is None and records_due(None, 5.0) is None
    assert rate_at(ConstantProfile(rate=7.0), 123.0) == 7.0
    assert records_due(ConstantProfile(rate=7.0), 3.0) == pytest.approx(21.0)

    step = StepProfile(kind="step", rate=10.0, to=30.0, at=2.0)
    assert rate_at(step, 1.999) == 10.0 and rate_at(step, 2.0) == 30.0
    assert records_due(step, 5.0) == pytest.approx(20.0 + 90.0)

    ramp = RampProfile(kind="ramp", rate=0.0, to=100.0, over=10.0)
    assert rate_at(ramp, 5.0) == pytest.approx(50.0) and rate_at(ramp, 50.0) == 100.0
    assert records_due(ramp, 10.0) == pytest.approx(500.0)
    assert records_due(ramp, 12.0) == pytest.approx(700.0)

    sine = SineProfile(kind="sine", rate=100.0, amplitude=50.0, period=4.0)
    assert rate_at(sine, 1.0) == pytest.approx(150.0)
    assert rate_at(sine, 3.0) == pytest.approx(50.0)
    assert records_due(sine, 4.0) == pytest.approx(400.0)  # whole periods average to the mean
    assert records_due(sine, 2.0) == pytest.approx(200.0 + 50.0 * 4.0 / math.pi)

    points = PointsProfile(kind="points", points=[(1.0, 10.0), (3.0, 0.0), (4.0, 5.0)])
    assert rate_at(points, 0.5) == 0.0
    assert rate_at(points, 1.0) == 10.0 and rate_at(points, 3.5) == 0.0
    assert rate_at(points, 100.0) == 5.0
    assert records_due(points, 1.0) == 0.0
    assert records_due(points, 3.5) == pytest.approx(20.0)
    assert records_due(points, 6.0) == pytest.approx(30.0)


# ------------------------------------------------------------------------------------------
# Instance split


def test_instance_totals_sum_to_total() -> None:
    for total in (0, 1, 5, 99, 100, 1001, 10**12 + 7):
        for p in (1, 2, 3, 7, 64):
            shares = [instance_total(total, i, p) for i in range(p)]
            assert all(s is not None for s in shares)
            ints = [s for s in shares if s is not None]
            assert sum(ints) == total
            assert max(ints) - min(ints) <= 1
            assert ints == sorted(ints, reverse=True)  # extras go to the low indices
            assert [InstanceShare(i, p).total(total) for i in range(p)] == ints
    assert instance_total(None, 0, 3) is None
    for bad in ((0, 0), (3, 3), (-1, 2)):
        with pytest.raises(ValueError):
            instance_total(10, *bad)
        with pytest.raises(ValueError):
            InstanceShare(*bad)


def test_instance_share_splits_rate() -> None:
    profile = RampProfile(kind="ramp", rate=90.0, to=300.0, over=3.0)
    shares = [InstanceShare(i, 3) for i in range(3)]
    for t in (0.0, 1.0, 2.5, 7.0):
        rate, due = rate_at(profile, t), records_due(profile, t)
        assert rate is not None and due is not None
        assert sum(s.rate_at(profile, t) or 0.0 for s in shares) == pytest.approx(rate)
        assert sum(s.records_due(profile, t) or 0.0 for s in shares) == pytest.approx(due)
    assert shares[0].fraction == pytest.approx(1 / 3)
    assert shares[1].rate_at(None, 1.0) is None


# ------------------------------------------------------------------------------------------
# Pacing


def run_pacer(pacer: Pacer, until: float, step: float, start: float = 0.0, emitted: int = 0) -> int:
    """Emit whatever is due at each tick; return the emitted count (checks the invariants)."""
    for i in range(round((until - start) / step) + 1):
        due = pacer.due(start + i * step, emitted)
        assert due is not None and due >= 0
        emitted += due
        if pacer.total is not None:
            assert emitted <= pacer.total
    return emitted


def test_pacer_follows_profile_and_catches_up() -> None:
    pacer = Pacer(ConstantProfile(rate=1000.0), 0.5, None)
    assert pacer.due(0.0, 0) == 0
    emitted = run_pacer(pacer, until=1.0, step=0.01)
    assert emitted == 500
    # A pause of two seconds: everything due is released at once.
    assert pacer.due(3.0, emitted) == 1000
    assert pacer.due(3.0, emitted + 1000) == 0
    assert pacer.due(3.0, emitted + 5000) == 0  # ahead of schedule: nothing, never negative
    assert not pacer.done(10**9)


def test_pacer_exact_counts_despite_float_rounding() -> None:
    pacer = Pacer(ConstantProfile(rate=1000.0), 1 / 3, None)
    assert pacer.due(0.003, 0) == 1
    assert pacer.due(0.3, 0) == 100
    assert Pacer(ConstantProfile(rate=10.0), 1.0, None).due(0.3, 0) == 3


def test_pacer_never_exceeds_total() -> None:
    profiles: list[LoadProfile | None] = [None, *PROFILES]
    for profile in profiles:
        for p in (1, 3):
            instance_totals = [InstanceShare(i, p).total(1001) for i in range(p)]
            emitted_all = 0
            for i in range(p):
                pacer = InstanceShare(i, p).pacer(profile, 1001)
                assert pacer.total == instance_totals[i]
                emitted = run_pacer(pacer, until=40.0, step=0.25)
                offered = records_due(profile, 40.0)
                assert pacer.total is not None
                if offered is None or offered / p >= pacer.total:
                    assert pacer.done(emitted)
                else:  # the profile ends at rate 0 before the total
                    assert emitted == math.floor(offered / p + 1e-9)
                assert pacer.due(100.0, emitted) == 0
                emitted_all += emitted
            assert emitted_all <= 1001


def test_pacer_unlimited() -> None:
    assert Pacer(None, 1.0, None).due(0.0, 10**9) is None
    assert Pacer(None, 1.0, None).seconds_until_next(0.0, 5) == 0.0
    limited = Pacer(None, 0.5, 100)
    assert limited.due(0.0, 0) == 100
    assert limited.due(0.0, 40) == 60
    assert limited.due(0.0, 100) == 0 and limited.done(100)
    assert limited.rate(1.0) is None
    with pytest.raises(ValueError):
        Pacer(None, 0.0, None)
    with pytest.raises(ValueError):
        Pacer(None, 1.0, -1)


def test_pacer_wait_hint() -> None:
    pacer = Pacer(ConstantProfile(rate=100.0), 1.0, None)
    assert pacer.seconds_until_next(0.5, 10) == 0.0  # 50 due, 10 emitted
    wait = pacer.seconds_until_next(0.001, 1)  # next record due at 0.02
    assert wait == pytest.approx(0.019, abs=1e-5)
    assert pacer.due(0.001 + wait, 1) == 1

    slow = Pacer(ConstantProfile(rate=1.0), 1.0, None)
    assert slow.seconds_until_next(0.0, 0) == MAX_WAIT_SECONDS

    # A rate-0 phase followed by load: the hint stays bounded and ends where load starts.
    points = Pacer(PointsProfile(kind="points", points=[(0.0, 0.0), (1.0, 1000.0)]), 1.0, None)
    assert points.seconds_until_next(0.2, 0) == MAX_WAIT_SECONDS
    wait = points.seconds_until_next(0.98, 0)
    assert 0.02 <= wait <= 0.0215
    assert points.due(0.98 + wait, 0) == 1

    finished = Pacer(ConstantProfile(rate=100.0), 1.0, 5)
    assert finished.seconds_until_next(10.0, 5) == MAX_WAIT_SECONDS
    assert finished.rate(1.0) == 100.0


def test_arrival_inverts_the_load_profile() -> None:
    """The count-th record falls due when the integral of the rate reaches count."""
    pacer = Pacer(StepProfile(kind="step", rate=100, to=1000, at=2.0), 1.0, None)
    assert pacer.arrival(100, 10.0) == pytest.approx(1.0, abs=1e-6)
    assert pacer.arrival(200, 10.0) == pytest.approx(2.0, abs=1e-6)
    assert pacer.arrival(1200, 10.0) == pytest.approx(3.0, abs=1e-6)
    # Not yet due by `elapsed`, or no rate at all: it arrives now.
    assert pacer.arrival(10_000, 3.0) == 3.0
    assert Pacer(None, 1.0, None).arrival(5, 7.0) == 7.0


def test_a_resumed_source_picks_up_its_profile_where_its_position_fell_due() -> None:
    """A source restarted from a checkpoint at record n goes on at the time n records were due."""
    step = StepProfile(kind="step", rate=1000, to=2000, at=10)
    pacer = Pacer(step, share=1.0, total=None)
    assert pacer.elapsed_at(5000) == pytest.approx(5.0, abs=1e-6)
    assert pacer.elapsed_at(14_000) == pytest.approx(12.0, abs=1e-6)
    assert pacer.target(pacer.elapsed_at(14_000)) == 14_000
    assert pacer.elapsed_at(0) == 0.0
    assert Pacer(None, share=1.0, total=100).elapsed_at(50) == 0.0  # no rate: at once
