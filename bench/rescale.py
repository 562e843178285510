"""Live rescale benchmark: end-to-end latency while a keyed count rescales 1 -> 2 -> 1.

One generator instance -> a keyed `count` ("counts") -> one sink, 1,000,000 distinct keys,
Zipf 1.0, batches of 8,192 records (linger 5 ms, 8 credits). The source runs at a constant rate R,
calibrated at the start as 0.65 x the rate the same job reaches at full speed (so the one keyed
instance is about 65 % busy; `--rate` overrides). Then, for each strategy in turn (all-at-once,
batched, hot-first, lazy), a fresh job: warm-up (most keys exist), a steady window, a live
rescale 1 -> 2 with that strategy (this script plays the host: it starts the instances the
coordinator wants), a steady window, a rescale 2 -> 1, half a steady window, drain. Throughout,
the sink's per-batch worst end-to-end latencies are collected into a latency-over-time series.

Reported per strategy: steady p50/p99 latency; p99 and max latency in each rescale window
[start, end + 1 s]; rescale duration, bytes, MB/s, keys moved (pushed + fetched on demand),
records parked, fetch requests; state size at rescale start; how long after the rescale's end
the latency stays under 2x the steady p99 again (for 2 s); steady keyed throughput (and each
instance's busy / backpressured share at parallelism 1 and 2); and a correctness check. The
targets (hot-first p99 <= 3x steady p99; hot-first max <= 1/10 of all-at-once's; state moves
>= 100 MB/s; throughput with migration support within 5 % of the throughput benchmark) are
evaluated and printed as met / not met.

Latency and a paused source. The sink measures ingest -> emit, and the generator stamps each
record with the time it fell due on its load profile, so a paused (all-at-once) or backpressured
source's wait shows at the sink. The script also tracks how far the source was behind its
constant-rate schedule (from its `emitted` counter) and reports each window's latency with that
wait added once more ("with source lag"): an upper bound that counts the wait twice, kept for
comparison with runs made before records carried their due time. Targets are judged on the
sink's measure.

Correctness check: the sink writes a parquet output log; after the drain, the sum of `n` over
all outputs must equal the records the source emitted, and every key's final count (the max of
its `value`s: counts only grow, wherever the key lived) must equal how often the key occurs in
the source's first `emitted` records, regenerated independently with `KeyGenerator` from the
seed. Measured before choosing: at full speed the parquet sink costs about half a core but does
not lower the keyed rate, and at R the keyed instance still keeps up with the offered load (the
report shows steady throughput vs R), so the check runs on the measured runs themselves.
`--sink-format none` skips it (and the parquet cost).

Throughput comparison: the paced runs' steady throughput is R by construction, so capacity is
measured apart, as an A/B in this invocation: bench/throughput.py's pipeline (65,536-record
batches, full speed) on the code just before live rescaling (commit 3bf0566, read with
`git archive`) and on this tree, alternated `--throughput-rounds` times; medians compared.

Two narrower comparisons replace the strategy runs when asked for (both need `--rate`):
`--standby-rounds N` times a hot-first 1 -> 2 with and without a standby; `--pacing-rounds N`
runs a hot-first 1 -> 2 (with a standby, so the window is the move) unpaced and paced to
`--max-latency-ms`, alternated, and reports the sink's steady p99, its p99 and max in the
rescale's window, the move's duration and the pacer's report (met, worst p99, rates chosen).

`--to N` scales 1 -> N -> 1 instead (N >= 3 is where concurrent subscales differ from one
step: the new owners' subscales); `--option NAME=VALUE` passes a strategy option to every
rescale (`subscales=0`: the older global steps, for an A/B in one tree). The targets keep
their 1->2 names.

Run: `.venv/bin/python bench/rescale.py` (about 5 minutes). Writes bench/reports/rescale.json
(all numbers and raw series) and bench/reports/rescale.png (latency over time per strategy,
t = 0 at each run's first rescale, rescale windows shaded).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow.compute as pc
import yaml
from throughput import ratio, snapshot

from keyshift.operator.local_host import COORDINATOR_SERVICE, LocalJob, RunError
from keyshift.runtime import protocol
from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.job import GeneratorSource, parse_job
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient, TransportError

STRATEGIES = tuple(sorted(protocol.STRATEGIES))  # in a fixed order for tables and plots
DISTRIBUTIONS = {"zipf": "Zipf 1.0", "uniform": "uniform"}
KEYED = "counts"
SEED = 1
BATCHING = {"max_records": 8192, "linger_ms": 5, "credits": 8}
LOAD_SHARE = 0.65
CALIBRATION_WARMUP = 10.0
CALIBRATION_WINDOW = 5.0
POLL = 0.2  # seconds between status polls; 0.1 while a rescale runs
RESCALE_POLL = 0.1
WINDOW_TAIL = 1.0  # a rescale's latency window is [start, end + this]
RECOVERY_HOLD = 2.0  # recovered: latency under 2x the steady p99 for this long
RESCALE_TIMEOUT = 300.0
START_TIMEOUT = 120.0
DRAIN_TIMEOUT = 120.0
TRUTH_CHUNK = 4_000_000
TOP_BIN = 0.25  # seconds per point in the chart's combined panel (max of the bin)
# bench/README.md, 2026-11-21 (commit 2353f5b, before live rescaling was added).
RECORDED_THROUGHPUT = {"keyed_records_per_s": 3_263_089, "ratio_to_dict_loop": 1.193}
BASELINE_COMMIT = "3bf0566"  # the parent of 0c9b84a, the commit that added live rescaling
THROUGHPUT_WARMUP = 4.0
REPO = Path(__file__).resolve().parent.parent
# The baseline's measure_pipeline predates state backends (memory then, the default now).
MEASURE = (
    "import inspect, json, sys; sys.path.insert(0, sys.argv[1]); "
    "from throughput import measure_pipeline as measure; "
    "backend = inspect.signature(measure).parameters.keys() & {'backend'}; "
    "backend = {'backend': 'memory'} if backend else {}; "
    "print(json.dumps(measure(65536, float(sys.argv[2]), float(sys.argv[3]), **backend)))"
)
TARGET_P99_FACTOR = 3.0
TARGET_MAX_SHARE = 0.1
TARGET_MB_PER_S = 100.0
TARGET_THROUGHPUT_LOSS = 0.05

T = TypeVar("T")
BEGAN = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - BEGAN:6.1f} s] {message}", flush=True)


def source_config(keys: int, rate: float | None, distribution: str = "zipf") -> dict[str, Any]:
    config: dict[str, Any] = {
        "kind": "generator",
        "keys": keys,
        "distribution": distribution,
        "zipf_exponent": 1.0,
        "seed": SEED,
    }
    if rate is not None:
        config["profile"] = {"kind": "constant", "rate": rate}
    return config


def job(
    keys: int, rate: float | None, out: Path | None, distribution: str = "zipf"
) -> dict[str, Any]:
    sink = (
        {"kind": "log", "path": str(out), "format": "parquet"}
        if out is not None
        else {"kind": "log", "format": "none"}
    )
    return {
        "name": "bench-rescale",
        "source": {"parallelism": 1, "config": source_config(keys, rate, distribution)},
        "keyed": {"name": KEYED, "parallelism": 1, "operator": {"function": "count"}},
        "sink": {"parallelism": 1, "config": sink},
        "batching": BATCHING,
    }


def start_job(spec_data: dict[str, Any], work: Path) -> LocalJob:
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(spec_data))
    # The shared machine may be loaded enough that processes take more than the default 30 s.
    return LocalJob(
        parse_job(spec_data),
        path,
        log_dir=work / "logs",
        start_timeout=START_TIMEOUT,
        register_timeout=START_TIMEOUT,
    )


def stage(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in status["stages"] if s["name"] == name)


def keyed_stats(status: dict[str, Any], name: str = KEYED) -> dict[int, dict[str, Any]]:
    return {i["index"]: i["stats"] for i in stage(status, name)["instances"]}


def keyed_rate(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> float:
    """Records/s into the keyed stage: each instance's own counter over its own clock."""
    total = 0.0
    for index, now in after.items():
        then = before.get(index)
        if then is not None and now.get("time", 0) > then.get("time", 0):
            total += ratio(then, now, "records_in")
    return total


def all_stats(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        f"{st['name']}/{i['index']}": i["stats"] for st in status["stages"] for i in st["instances"]
    }


def usage(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per instance over a window: records in per second and the busy / backpressured share."""
    found = {}
    for name, now in after.items():
        then = before.get(name)
        if then is not None and now.get("time", 0) > then.get("time", 0):
            found[name] = {
                "records_in_per_s": round(ratio(then, now, "records_in")),
                "busy": round(ratio(then, now, "busy"), 3),
                "backpressured": round(ratio(then, now, "backpressured"), 3),
            }
    return found


def brief(found: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {u['records_in_per_s']:,} rec/s busy {u['busy']:.0%}"
        + (f" backpressured {u['backpressured']:.0%}" if u["backpressured"] >= 0.005 else "")
        for name, u in found.items()
    )


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def max_ms(values: list[float]) -> float | None:
    return round(max(values) * 1e3, 2) if values else None


class Probe:
    """Polls a running job, plays its host (starts the instances the coordinator wants) and
    keeps the sink's per-batch latencies and each rescale's phase timeline. `source` and
    `sink` name the job's source and sink stages."""

    def __init__(
        self, local: LocalJob, began: float, source: str = "source", sink: str = "sink"
    ) -> None:
        self.local = local
        self.began = began
        self.source = source
        self.sink = sink
        self.latency: dict[float, float] = {}  # sink emit time (s) -> worst latency of the batch
        self.phases: list[tuple[float, int, str]] = []  # (time first seen, rescale id, phase)
        self.emitted: dict[float, float] = {}  # source report time (s) -> records emitted so far
        self.status: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        self.local.check_children(expect_exit=False)
        try:
            status = self.local.status()
        except TransportError as exc:
            self.local.check_children(expect_exit=False)
            raise RunError(f"coordinator stopped answering: {exc}") from None
        self.local.ensure_instances(status)
        if status["phase"] == "failed":
            raise RunError("job failed: " + "; ".join(status["errors"]))
        for instance in stage(status, self.sink)["instances"]:
            for emitted, worst in instance["stats"].get("latency_recent", []):
                self.latency[float(emitted)] = float(worst)
        for instance in stage(status, self.source)["instances"]:
            stats = instance["stats"]
            if "emitted" in stats and "time" in stats:
                self.emitted[float(stats["time"])] = float(stats["emitted"])
        rescale = status.get("rescale")
        if rescale is not None and (
            not self.phases or self.phases[-1][1:] != (rescale["id"], rescale["phase"])
        ):
            self.phases.append((time.time(), rescale["id"], rescale["phase"]))
        self.status = status
        return status

    def run_for(self, seconds: float, every: float = POLL) -> None:
        end = time.monotonic() + seconds
        while True:
            self.poll()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(every, left))

    def until(
        self,
        condition: Callable[[dict[str, Any]], T | None],
        timeout: float,
        what: str,
        every: float = POLL,
    ) -> T:
        deadline = time.monotonic() + timeout
        while True:
            value = condition(self.poll())
            if value:
                return value
            if time.monotonic() > deadline:
                raise RunError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def samples(self, start: float, end: float) -> list[tuple[float, float]]:
        """(emit time, worst latency) of the sink batches emitted in [start, end]."""
        return sorted((t, v) for t, v in self.latency.items() if start <= t <= end)


class ScheduleLag:
    """How far the source was behind its constant-rate schedule over time, in seconds.

    The sink measures ingest -> emit, and the source stamps ingest time when it makes a record.
    A source that is paused (all-at-once) or backpressured makes its records late and then
    catches up, so that wait is invisible at the sink. With a constant rate R the schedule is
    `emitted = R * (t - t0)`, so `lag(t) = t - emitted(t) / R - t0`; t0 is set so that the
    median lag over the steady window is 0 (batching keeps it a few ms off otherwise).
    """

    def __init__(
        self, probe: Probe, rate: float, steady: tuple[float, float], until: float
    ) -> None:
        points = sorted((t, e) for t, e in probe.emitted.items() if t <= until)
        self.t = np.array([t for t, _ in points])
        behind = self.t - np.array([e for _, e in points]) / rate
        in_steady = (self.t >= steady[0]) & (self.t <= steady[1])
        base = float(np.median(behind[in_steady])) if in_steady.any() else float(behind.min())
        self.lag = np.maximum(behind - base, 0.0)
        self.until = until

    def at(self, times: np.ndarray) -> np.ndarray:
        return np.asarray(np.interp(times, self.t, self.lag))

    def max_in(self, start: float, end: float) -> float:
        inside = (self.t >= start) & (self.t <= end)
        return float(self.lag[inside].max()) if inside.any() else 0.0


def window_stats(probe: Probe, lag: ScheduleLag, start: float, end: float) -> dict[str, Any]:
    """Latency in [start, end]: as the sink measured it, and with the time each batch's
    records had waited behind the source's schedule added (at their ingest time)."""
    samples = probe.samples(start, end)
    measured = [v for _, v in samples]
    emitted = np.array([t for t, _ in samples])
    worst = np.array(measured)
    added = lag.at(emitted - worst) if samples else np.array([])
    corrected = (worst + added).tolist()
    return {
        "latency_samples": len(samples),
        "p50_ms": percentile_ms(measured, 50),
        "p99_ms": percentile_ms(measured, 99),
        "max_ms": max_ms(measured),
        "p99_ms_with_source_lag": percentile_ms(corrected, 99),
        "max_ms_with_source_lag": max_ms(corrected),
        "source_lag_max_ms": round(lag.max_in(start, end) * 1e3, 2),
    }


def recovery_s(probe: Probe, after: float, limit: float, until: float) -> float | None:
    """Seconds from `after` until the sink's latency stays under `limit` for RECOVERY_HOLD s
    (None if it does not before `until`, the drain)."""
    samples = probe.samples(after, until)
    times = np.array([t for t, _ in samples])
    worst = np.array([v for _, v in samples])
    start = after
    while start + RECOVERY_HOLD <= until:
        inside = (times >= start) & (times < start + RECOVERY_HOLD)
        if inside.any() and worst[inside].max() < limit:
            return round(start - after, 2)
        start += 0.1
    return None


def series(probe: Probe, lag: ScheduleLag | None) -> dict[str, Any]:
    times = sorted(probe.latency)
    worst = np.array([probe.latency[t] for t in times])
    found: dict[str, Any] = {
        "t": [round(t - probe.began, 4) for t in times],
        "latency_ms": [round(v * 1e3, 3) for v in worst.tolist()],
    }
    if lag is not None and times:
        emitted = np.array(times)
        corrected = worst + lag.at(emitted - worst)
        found["latency_with_source_lag_ms"] = [
            round(c * 1e3, 3) if t <= lag.until else None
            for t, c in zip(times, corrected.tolist(), strict=True)
        ]
        found["source_lag"] = {
            "t": [round(t - probe.began, 3) for t in lag.t.tolist()],
            "lag_ms": [round(v * 1e3, 2) for v in lag.lag.tolist()],
        }
    return found


def wait_flowing(probe: Probe) -> None:
    probe.until(
        lambda s: s["phase"] == "running" and keyed_stats(s).get(0, {}).get("records_in", 0) > 0,
        60,
        "records to reach the keyed instance",
    )


def rescale(
    probe: Probe,
    client: JsonClient,
    parallelism: int,
    strategy: str,
    options: dict[str, float] | None = None,
    keyed: str = KEYED,
) -> dict[str, Any]:
    """Rescale the keyed stage `keyed` live with the strategy's `options` and wait for it,
    polling (and starting wanted instances) meanwhile."""
    state = keyed_stats(probe.status, keyed)
    state_bytes = sum(s.get("state_bytes", 0) for s in state.values())
    state_keys = sum(s.get("state_keys", 0) for s in state.values())
    called = time.time()
    request = protocol.RescaleRequest(
        stage=keyed,
        parallelism=parallelism,
        strategy=protocol.parse_strategy(strategy),
        options=options or {},
    )
    started = protocol.parse(protocol.RescaleReport, client.call("Rescale", request.wire()))
    result: dict[str, Any] = probe.until(
        lambda s: next((r for r in s["rescales"] if r["id"] == started.id), None),
        RESCALE_TIMEOUT,
        f"rescale to {parallelism} ({strategy})",
        every=RESCALE_POLL,
    )
    end = float(result["finished"])
    progress = result.get("progress", {})
    bytes_in = progress.get("bytes_in", 0.0)
    duration = end - called
    # Scale-outs first start and register new processes; the state moves after that.
    phases = [(t, p) for t, i, p in probe.phases if i == started.id]
    moving_from = next((t for t, p in phases if p not in ("requested", "starting-instances")), None)
    return {
        "from": result["from"],
        "to": result["to"],
        "phase": result["phase"],
        "error": result["error"],
        "start": round(called - probe.began, 4),
        "end": round(end - probe.began, 4),
        "duration_s": round(duration, 3),
        "state_keys_at_start": state_keys,
        "state_mb_at_start": round(state_bytes / 1e6, 2),
        "bytes_moved": bytes_in,
        "mb_moved": round(bytes_in / 1e6, 2),
        "mb_per_s": round(bytes_in / 1e6 / duration, 2) if duration > 0 else None,
        "mb_per_s_after_instances_start": (
            round(bytes_in / 1e6 / (end - moving_from), 2)
            if moving_from is not None and end > moving_from
            else None
        ),
        "keys_moved": progress.get("keys_in", 0) + progress.get("keys_fetched", 0),
        "keys_pushed": progress.get("keys_in", 0),
        "keys_fetched": progress.get("keys_fetched", 0),
        "fetch_requests": progress.get("fetch_requests", 0),
        "records_parked": progress.get("records_parked", 0),
        "records_forwarded": progress.get("records_forwarded", 0),
        "phases": [[round(t - probe.began, 3), p] for t, p in phases],
        "result": result,
    }


def read_output(out: Path, keys: int) -> dict[str, Any]:
    """Per key, the last count in the output log (the max: counts only grow); and sum of n."""
    reader = OutputLogReader(out)
    final = np.zeros(keys, dtype=np.int64)
    n_total = rows = 0
    for partition in reader.partitions():
        for segment in reader.segments(partition):
            table = reader.read(partition, segment.start, segment.end)
            np.maximum.at(final, table.column("key").to_numpy(), table.column("value").to_numpy())
            n_total += int(pc.sum(table.column("n")).as_py() or 0)
            rows += table.num_rows
    return {"final": final, "n_total": n_total, "rows": rows}


def truth_counts(keys: int, targets: list[int], distribution: str) -> dict[int, np.ndarray]:
    """Occurrences of each key in the source's first `target` records, for each target."""
    generator = KeyGenerator(
        GeneratorSource.model_validate(source_config(keys, None, distribution)), 0
    )
    counts = np.zeros(keys, dtype=np.int64)
    done = 0
    found = {}
    for target in sorted(set(targets)):
        while done < target:
            n = min(TRUTH_CHUNK, target - done)
            chunk, _ = generator.records(done, n)
            counts += np.bincount(chunk, minlength=keys)
            done += n
        found[target] = counts.copy()
    return found


def calibrate(keys: int, sink_format: str, distribution: str, root: Path) -> dict[str, Any]:
    """The same job (same sink) with no rate limit: records/s into the keyed instance."""
    work = Path(tempfile.mkdtemp(prefix="calibrate-", dir=root))
    out = work / "out" if sink_format == "parquet" else None
    with start_job(job(keys, None, out, distribution), work) as local:
        local.start()
        probe = Probe(local, time.time())
        wait_flowing(probe)
        probe.run_for(CALIBRATION_WARMUP)
        before = snapshot(local)
        probe.run_for(CALIBRATION_WINDOW)
        after = snapshot(local)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "full_speed_records_per_s": round(ratio(before[KEYED], after[KEYED], "records_in")),
        "keyed_busy": round(ratio(before[KEYED], after[KEYED], "busy"), 3),
        "source_backpressured": round(ratio(before["source"], after["source"], "backpressured"), 3),
        "sink_busy": round(ratio(before["sink"], after["sink"], "busy"), 3),
        "state_keys": after[KEYED].get("state_keys", 0),
        "warmup_s": CALIBRATION_WARMUP,
        "window_s": CALIBRATION_WINDOW,
    }


def run_strategy(
    strategy: str, args: argparse.Namespace, rate: float, root: Path
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{strategy}-", dir=root))
    out = work / "out" if args.sink_format == "parquet" else None
    report: dict[str, Any] = {
        "strategy": strategy,
        "rate": rate,
        "standby": args.standby,
        "log_dir": str(work / "logs"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    began = time.time()
    lag: ScheduleLag | None = None
    spec = job(args.keys, rate, out, args.distribution)
    if args.standby:
        spec["keyed"]["standby"] = args.standby
    with start_job(spec, work) as local:
        probe = Probe(local, began)
        try:
            local.start()
            wait_flowing(probe)
            say(f"{strategy}: running; warm-up {args.warmup:.0f} s")
            probe.run_for(args.warmup)
            if args.standby:
                probe.until(lambda s: stage(s, KEYED)["standbys"] or None, 60, "the standby")
            warm = keyed_stats(probe.status)[0]
            report["state_keys_after_warmup"] = warm.get("state_keys", 0)
            report["state_mb_after_warmup"] = round(warm.get("state_bytes", 0) / 1e6, 2)
            say(
                f"{strategy}: {report['state_keys_after_warmup']:,} keys, "
                f"{report['state_mb_after_warmup']} MB of state; steady {args.steady:.0f} s"
            )
            steady_from = time.time()
            before_all = all_stats(probe.poll())
            before = keyed_stats(probe.status)
            probe.run_for(args.steady)
            steady_rate = keyed_rate(before, keyed_stats(probe.status))
            report["steady_usage"] = usage(before_all, all_stats(probe.status))
            say(f"{strategy}: steady at parallelism 1: {brief(report['steady_usage'])}")
            rescales = []
            with_client = JsonClient(local.address, COORDINATOR_SERVICE, local.security)
            try:
                first = rescale(probe, with_client, args.to, strategy, args.options)
                rescales.append(first)
                say(
                    f"{strategy}: 1->{args.to} {first['phase']} in {first['duration_s']:.2f} s, "
                    f"{first['mb_moved']} MB, {first['keys_moved']:,.0f} keys"
                )
                if first["phase"] == "done":
                    before_out = keyed_stats(probe.poll())
                    before_all = all_stats(probe.status)
                    probe.run_for(args.steady)
                    report["scaled_out_records_per_s"] = round(
                        keyed_rate(before_out, keyed_stats(probe.status))
                    )
                    report["scaled_out_usage"] = usage(before_all, all_stats(probe.status))
                    say(
                        f"{strategy}: at parallelism {args.to}: {brief(report['scaled_out_usage'])}"
                    )
                    second = rescale(probe, with_client, 1, strategy, args.options)
                    rescales.append(second)
                    say(
                        f"{strategy}: {args.to}->1 {second['phase']} in "
                        f"{second['duration_s']:.2f} s, {second['mb_moved']} MB, "
                        f"{second['keys_moved']:,.0f} keys"
                    )
                    probe.run_for(args.steady / 2)
            finally:
                with_client.close()
            steady_to = first["start"] + began
            report["rescales"] = rescales
            report["t_zero"] = first["start"]
            say(f"{strategy}: draining")
            drained_at = time.time()
            local.drain()
            final = probe.until(
                lambda s: s if s["phase"] == "finished" else None, DRAIN_TIMEOUT, "the drain"
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                c.exit_code() is None for c in local.instances.values()
            ):
                time.sleep(0.05)
            local.check_children(expect_exit=True)
            report["emitted"] = sum(
                int(i["stats"].get("emitted", 0)) for i in stage(final, "source")["instances"]
            )
            lag = ScheduleLag(probe, rate, (steady_from, steady_to), drained_at)
            report["steady"] = {
                "window_s": args.steady,
                **window_stats(probe, lag, steady_from, steady_to),
                "records_per_s": round(steady_rate),
                "offered_records_per_s": round(rate),
                "share_of_offered": round(steady_rate / rate, 4),
            }
            for window in rescales:
                start, end = began + window["start"], began + window["end"] + WINDOW_TAIL
                window.update(window_stats(probe, lag, start, end))
                steady_p99 = report["steady"]["p99_ms"] or 0.0
                window["recovered_after_s"] = recovery_s(
                    probe, began + window["end"], 2 * steady_p99 / 1e3, drained_at
                )
                say(
                    f"{strategy}: {window['from']}->{window['to']} p99 {window['p99_ms']} ms, "
                    f"max {window['max_ms']} ms (steady p99 {report['steady']['p99_ms']} ms); "
                    f"with source lag: max {window['max_ms_with_source_lag']} ms; back under 2x "
                    f"steady p99 {window['recovered_after_s']} s after the end"
                )
        except (RunError, TransportError) as exc:
            report["error"] = str(exc)
            say(f"{strategy}: FAILED: {exc}")
        finally:
            report["series"] = series(probe, lag)
    if "error" not in report and out is not None:
        say(f"{strategy}: reading the output log")
        report["_output"] = read_output(out, args.keys)
    if "error" not in report:
        shutil.rmtree(work, ignore_errors=True)  # logs of failed runs are kept
    return report


def scale_out_once(
    spec: dict[str, Any],
    work: Path,
    args: argparse.Namespace,
    options: dict[str, float] | None = None,
    steady: float = 0.0,
) -> tuple[Probe, dict[str, Any], tuple[float, float]]:
    """A fresh job of `spec`: warm-up, `steady` seconds of steady window, the standbys waiting
    (if it keeps any), then a hot-first 1 -> 2 with `options`, and WINDOW_TAIL s after it (the
    records the move delayed reach the sink). The probe, the rescale, the steady window."""
    with start_job(spec, work) as local:
        probe = Probe(local, time.time())
        local.start()
        wait_flowing(probe)
        probe.run_for(args.warmup)
        steady_from = time.time()
        probe.run_for(steady)
        window = (steady_from, time.time())
        if spec["keyed"].get("standby"):
            probe.until(lambda s: stage(s, KEYED)["standbys"] or None, 60, "the standby")
        client = JsonClient(local.address, COORDINATOR_SERVICE, local.security)
        try:
            result = rescale(probe, client, 2, "hot-first", options)
        finally:
            client.close()
        probe.run_for(WINDOW_TAIL)
    return probe, result, window


def moved_at(result: dict[str, Any]) -> float:
    """When the rescale's state began to move (its instances had started), relative time."""
    starting = ("requested", "starting-instances")
    return float(next((t for t, p in result["phases"] if p not in starting), result["end"]))


def run_standby(standby: int, args: argparse.Namespace, rate: float, root: Path) -> dict[str, Any]:
    """One job with `standby` standbys of the keyed stage: warm-up, then a hot-first 1 -> 2;
    its time from the request to complete, and how much of it went to starting instances."""
    work = Path(tempfile.mkdtemp(prefix=f"standby-{standby}-", dir=root))
    spec = job(args.keys, rate, None, args.distribution)
    spec["keyed"]["standby"] = standby
    _probe, result, _steady = scale_out_once(spec, work, args)
    row = {
        "standby": standby,
        "phase": result["phase"],
        "state_keys_at_start": result["state_keys_at_start"],
        "duration_s": result["duration_s"],
        "starting_instances_s": round(moved_at(result) - result["start"], 3),
    }
    shutil.rmtree(work, ignore_errors=True)
    return row


def standby_compare(args: argparse.Namespace, rate: float, root: Path) -> int:
    """1 -> 2 with and without a standby, alternated `--standby-rounds` times in this run."""
    rows = []
    for _ in range(args.standby_rounds):
        for standby in (0, 1):
            row = run_standby(standby, args, rate, root)
            say(f"standby {standby}: {row}")
            rows.append(row)
    summary = {
        str(standby): {
            "duration_s": [r["duration_s"] for r in rows if r["standby"] == standby],
            "starting_instances_s": [
                r["starting_instances_s"] for r in rows if r["standby"] == standby
            ],
        }
        for standby in (0, 1)
    }
    with_standby = summary["1"]["duration_s"]
    met = all(r["phase"] == "done" for r in rows) and max(with_standby) <= 1.0
    result = {"rate": rate, "keys": args.keys, "runs": rows, "summary": summary,
              "target": target("rescale 1->2 complete <= 1 s from the request with a standby",
                               met, f"with a standby: {with_standby} s")}  # fmt: skip
    path = args.out_dir / "rescale-standby.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(r["phase"] == "done" for r in rows) else 1


def run_paced(
    objective_ms: float | None, args: argparse.Namespace, rate: float, root: Path
) -> dict[str, Any]:
    """One job with a standby: warm-up, a steady window, then a hot-first 1 -> 2 paced to
    `objective_ms` (None: unpaced); the sink's latency in the steady window and in the
    rescale's window (the request to its end + WINDOW_TAIL), the move's duration and what the
    pacer reported."""
    work = Path(tempfile.mkdtemp(prefix="paced-" if objective_ms else "unpaced-", dir=root))
    spec = job(args.keys, rate, None, args.distribution)
    # A standby takes the new process's start out of the rescale: its window is the move.
    spec["keyed"]["standby"] = 1
    options = {} if objective_ms is None else {"max_latency_ms": objective_ms}
    load = os.getloadavg()[0]
    probe, result, (steady_from, steady_to) = scale_out_once(spec, work, args, options, args.steady)
    steady = [v for _, v in probe.samples(steady_from, steady_to)]
    start, end = probe.began + result["start"], probe.began + result["end"] + WINDOW_TAIL
    during = [v for _, v in probe.samples(start, end)]
    pacing = result["result"].get("pacing") or {}
    shutil.rmtree(work, ignore_errors=True)
    return {
        "max_latency_ms": objective_ms,
        "load_average_at_start": round(load, 2),
        "phase": result["phase"],
        "state_keys_at_start": result["state_keys_at_start"],
        "mb_moved": result["mb_moved"],
        "keys_moved": result["keys_moved"],
        "duration_s": result["duration_s"],
        "move_s": round(result["end"] - moved_at(result), 3),
        "steady_p99_ms": percentile_ms(steady, 99),
        "rescale_p99_ms": percentile_ms(during, 99),
        "rescale_max_ms": max_ms(during),
        "latency_samples": len(during),
        "pacing_met": pacing.get("met"),
        "pacing_worst_p99_ms": pacing.get("worst_p99_ms"),
        "pacing_keys_per_s": pacing.get("keys_per_s"),
    }


def pacing_compare(args: argparse.Namespace, rate: float, root: Path) -> int:
    """1 -> 2 unpaced and paced to `--max-latency-ms`, alternated `--pacing-rounds` times in
    this run; the target: the paced runs' sink p99 during the rescale within the objective."""
    rows = []
    for _ in range(args.pacing_rounds):
        for objective in (None, args.max_latency_ms):
            row = run_paced(objective, args, rate, root)
            say(f"max_latency_ms {objective}: {row}")
            rows.append(row)
    paced = [r for r in rows if r["max_latency_ms"] is not None]
    met = all(r["phase"] == "done" and r["pacing_met"] for r in paced) and all(
        (r["rescale_p99_ms"] or 0.0) <= args.max_latency_ms for r in paced
    )
    detail = (
        f"paced p99 {[r['rescale_p99_ms'] for r in paced]} ms, pacing.met "
        f"{[r['pacing_met'] for r in paced]}; unpaced p99 "
        f"{[r['rescale_p99_ms'] for r in rows if r['max_latency_ms'] is None]} ms"
    )
    result = {
        "rate": rate,
        "keys": args.keys,
        "distribution": args.distribution,
        "objective_ms": args.max_latency_ms,
        "runs": rows,
        "target": target("sink p99 during a paced 1->2 <= max_latency_ms", met, detail),
    }
    path = args.out_dir / "rescale-pacing.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(r["phase"] == "done" for r in rows) else 1


def check_correctness(reports: list[dict[str, Any]], keys: int, distribution: str) -> None:
    checked = [r for r in reports if "_output" in r]
    if not checked:
        return
    say(
        f"regenerating the source's keys for the correctness check "
        f"({max(r['emitted'] for r in checked):,} records)"
    )
    truth = truth_counts(keys, [r["emitted"] for r in checked], distribution)
    for report in checked:
        output = report.pop("_output")
        expected = truth[report["emitted"]]
        wrong = int(np.count_nonzero(output["final"] != expected))
        report["correctness"] = {
            "check": "sum(n) over the parquet output == emitted, and per key max(value) == "
            "occurrences in the regenerated first `emitted` source records",
            "emitted": report["emitted"],
            "output_rows": output["rows"],
            "output_n_sum": output["n_total"],
            "keys_with_records": int(np.count_nonzero(expected)),
            "keys_wrong": wrong,
            "keys_over": int(np.count_nonzero(output["final"] > expected)),
            "keys_under": int(np.count_nonzero(output["final"] < expected)),
            "ok": wrong == 0 and output["n_total"] == report["emitted"],
        }


def package_tree(source: Path, dest: Path) -> Path:
    """A folder for PYTHONPATH whose keyshift/ links to `source`'s package folders."""
    (dest / "keyshift").mkdir(parents=True)
    for name in ("runtime", "policies", "operator"):
        if (source / name).is_dir():
            (dest / "keyshift" / name).symlink_to(source / name)
    return dest


def baseline_source(dest: Path, commit: str = BASELINE_COMMIT) -> Path:
    """The repository's files at `commit`, read with `git archive` (nothing checked out)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit,
         "runtime", "policies", "operator", "bench"],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def measure_tree(source: Path, package: Path, warmup: float, window: float) -> float:
    """bench/throughput.py's pipeline measurement of the code in `source`, in a subprocess
    (its instances inherit PYTHONPATH, so they run that code too)."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", MEASURE, str(source / "bench"), str(warmup), str(window)],
        env={**os.environ, "PYTHONPATH": str(package)},
        capture_output=True, text=True, timeout=warmup + window + 120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"throughput measurement of {source} failed:\n{done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["records_per_s"])


def throughput_check(window: float, rounds: int, root: Path) -> dict[str, Any]:
    """A/B: bench/throughput.py's pipeline (65,536-record batches, full speed) on the code just
    before live rescaling and on this tree, alternated `rounds` times in this run."""
    old = baseline_source(root / "baseline-src")
    trees = {
        "before_rescaling": (old, package_tree(old, root / "baseline-pkg")),
        "current": (REPO, package_tree(REPO, root / "current-pkg")),
    }
    runs: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(rounds):
        for name, (source, package) in trees.items():
            runs[name].append(measure_tree(source, package, THROUGHPUT_WARMUP, window))
            say(f"throughput round {round_ + 1}/{rounds}: {name} {runs[name][-1]:,.0f} rec/s")
    before, current = (float(np.median(runs[n])) for n in trees)
    return {
        "baseline_commit": BASELINE_COMMIT,
        "before_rescaling_records_per_s": round(before),
        "current_records_per_s": round(current),
        "current_vs_before": round(current / before, 4),
        "runs": {n: [round(x) for x in v] for n, v in runs.items()},
        "recorded_in_readme": RECORDED_THROUGHPUT,
        "batch": 65536,
        "warmup_s": THROUGHPUT_WARMUP,
        "window_s": window,
        "rounds": rounds,
    }


def target(name: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": name, "met": met, "detail": detail}


def evaluate(
    reports: list[dict[str, Any]], throughput: dict[str, Any] | None
) -> list[dict[str, Any]]:
    ok = {r["strategy"]: r for r in reports if "error" not in r and len(r["rescales"]) == 2}
    found: list[dict[str, Any]] = []
    hot, aao = ok.get("hot-first"), ok.get("all-at-once")
    name = f"hot-first p99 during each rescale <= {TARGET_P99_FACTOR:g}x its steady p99"
    if hot is not None and hot["steady"]["p99_ms"]:
        limit = TARGET_P99_FACTOR * hot["steady"]["p99_ms"]
        p99s = [r["p99_ms"] for r in hot["rescales"]]
        lagged = [r["p99_ms_with_source_lag"] for r in hot["rescales"]]
        met = all(p is not None and p <= limit for p in p99s)
        found.append(
            target(
                name,
                met,
                f"steady p99 {hot['steady']['p99_ms']} ms (limit {limit:.1f} ms); 1->2 "
                f"{p99s[0]} ms, 2->1 {p99s[1]} ms (with source lag: steady "
                f"{hot['steady']['p99_ms_with_source_lag']} ms, 1->2 {lagged[0]} ms, "
                f"2->1 {lagged[1]} ms)",
            )
        )
    else:
        found.append(target(name, None, "hot-first did not run"))
    name = f"hot-first max latency <= {TARGET_MAX_SHARE:g} x all-at-once's (same run)"
    if hot is not None and aao is not None:

        def worst(report: dict[str, Any], key: str) -> float:
            return max(float(r[key] or 0) for r in report["rescales"])

        hot_max, aao_max = worst(hot, "max_ms"), worst(aao, "max_ms")
        hot_lag, aao_lag = (worst(r, "max_ms_with_source_lag") for r in (hot, aao))
        found.append(
            target(
                name,
                hot_max <= TARGET_MAX_SHARE * aao_max,
                f"hot-first {hot_max} ms, all-at-once {aao_max} ms (ratio "
                f"{hot_max / max(aao_max, 1e-9):.2f}); with source lag: hot-first {hot_lag} "
                f"ms, all-at-once {aao_lag} ms (ratio {hot_lag / max(aao_lag, 1e-9):.2f})",
            )
        )
    else:
        found.append(target(name, None, "hot-first or all-at-once did not run"))
    name = f"state moves >= {TARGET_MB_PER_S:g} MB/s (hot-first, bytes in / rescale duration)"
    if hot is not None:
        rates = [r["mb_per_s"] or 0 for r in hot["rescales"]]
        moving = [r["mb_per_s_after_instances_start"] for r in hot["rescales"]]
        best = max(
            ((r["mb_per_s"] or 0, s) for s, rep in ok.items() for r in rep["rescales"]),
            default=(0, "-"),
        )
        found.append(
            target(
                name,
                all(x >= TARGET_MB_PER_S for x in rates),
                f"hot-first 1->2 {rates[0]} MB/s ({moving[0]} MB/s after the new "
                f"instance registered), 2->1 {rates[1]} MB/s; best of all "
                f"strategies {best[0]} MB/s ({best[1]})",
            )
        )
    else:
        found.append(target(name, None, "hot-first did not run"))
    name = (
        f"throughput with migration support within {TARGET_THROUGHPUT_LOSS:.0%} of the "
        "throughput benchmark"
    )
    if throughput is not None:
        share = throughput["current_vs_before"]
        found.append(
            target(
                name,
                share >= 1 - TARGET_THROUGHPUT_LOSS,
                f"bench/throughput.py pipeline, A/B in this run (median of "
                f"{throughput['rounds']}): before live rescaling ({BASELINE_COMMIT}) "
                f"{throughput['before_rescaling_records_per_s']:,} rec/s, now "
                f"{throughput['current_records_per_s']:,} rec/s ({share:.1%})",
            )
        )
    else:
        found.append(target(name, None, "throughput check skipped (--throughput-window 0)"))
    return found


def binned_max(t: np.ndarray, values: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    """The max of `values` per `width`-second bin of `t` (bins without samples left out)."""
    bins = np.floor(t / width).astype(np.int64)
    edges = np.flatnonzero(np.diff(bins)) + 1
    starts = np.concatenate([[0], edges])
    return (bins[starts] + 0.5) * width, np.maximum.reduceat(values, starts)


def plot(
    reports: list[dict[str, Any]], keys: int, distribution: str, steady: float, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in reports if "t_zero" in r and r["series"]["t"]]
    if not shown:
        return
    n = len(shown)
    fig, axes = plt.subplots(
        2 + n,
        1,
        figsize=(12, 7.5 + 1.5 * n),
        sharex=True,
        gridspec_kw={"height_ratios": [2.4, 2.4] + [1.0] * n},
    )
    combined = (axes[0], axes[1])
    colors = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}
    end = 0.0
    for row, report in enumerate(shown, start=2):
        color = colors[report["strategy"]]
        zero = report["t_zero"]
        data = report["series"]
        t = np.asarray(data["t"]) - zero
        keep = t >= -steady - 2
        end = max(end, float(t[keep].max()))
        measured = np.asarray(data["latency_ms"], dtype=float)
        corrected = np.asarray(
            [np.nan if v is None else v for v in data.get("latency_with_source_lag_ms", [])],
            dtype=float,
        )
        for ax, values in zip(combined, (measured, corrected), strict=True):
            ok = keep & np.isfinite(values) if len(values) == len(t) else np.zeros_like(keep)
            if ok.any():
                bt, bmax = binned_max(t[ok], values[ok], TOP_BIN)
                ax.plot(bt, np.maximum(bmax, 0.1), lw=1.0, color=color, label=report["strategy"])
        axes[row].plot(t[keep], np.maximum(measured[keep], 0.1), lw=0.5, color=color)
        if "source_lag" in data:
            lt = np.asarray(data["source_lag"]["t"]) - zero
            lag = np.asarray(data["source_lag"]["lag_ms"], dtype=float)
            lag[lag < 1.0] = np.nan
            axes[row].plot(lt, lag, lw=1.0, ls=":", color="black")
        for ax in (*combined, axes[row]):
            for window in report["rescales"]:
                start, stop = window["start"] - zero, window["end"] - zero
                ax.axvspan(start, stop, color=color, alpha=0.12 if ax in combined else 0.25)
                ax.axvline(start, color=color, lw=0.8, ls="--")
        for window in report["rescales"]:
            axes[row].annotate(
                f"{window['from']}→{window['to']} {window['duration_s']:.1f} s, "
                f"max {window.get('max_ms') or 0:.0f} ms",
                (window["start"] - zero, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                va="top",
                fontsize=7,
            )
        axes[row].set_ylabel(report["strategy"], fontsize=8)
        axes[row].tick_params(labelsize=7)
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel(f"latency at the sink (ms)\nmax per {TOP_BIN:g} s", fontsize=9)
    axes[1].set_ylabel(f"+ wait behind the\nsource's schedule (ms)\nmax per {TOP_BIN:g} s",
                       fontsize=9)  # fmt: skip
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_title(
        f"keyed count, {keys:,} keys {DISTRIBUTIONS[distribution]}, {shown[0]['rate']:,.0f} "
        "rec/s: live rescale 1→2→1; shaded from each rescale's start to its end\n"
        "top: ingest → sink as the sink measures it; second: plus the time the records waited "
        "behind the source's constant-rate schedule (paused or backpressured source)\n"
        "lower panels: worst latency of each sink batch (solid) and how far the source was "
        "behind schedule (dotted)",
        fontsize=9,
    )
    axes[-1].set_xlabel("seconds since the run's first rescale started")
    axes[-1].set_xlim(-steady - 2, end)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in reports:
        if "error" in r:
            rows.append({"strategy": r["strategy"], "error": r["error"]})
            continue
        row: dict[str, Any] = {
            "strategy": r["strategy"],
            "steady_p50_ms": r["steady"]["p50_ms"],
            "steady_p99_ms": r["steady"]["p99_ms"],
            "steady_p99_ms_with_source_lag": r["steady"]["p99_ms_with_source_lag"],
            "steady_records_per_s": r["steady"]["records_per_s"],
        }
        for w in r["rescales"]:
            tag = "out" if w["to"] > w["from"] else "in"
            row.update(
                {
                    f"{tag}_s": w["duration_s"],
                    f"{tag}_p99_ms": w["p99_ms"],
                    f"{tag}_max_ms": w["max_ms"],
                    f"{tag}_max_ms_with_source_lag": w["max_ms_with_source_lag"],
                    f"{tag}_recovered_after_s": w["recovered_after_s"],
                    f"{tag}_state_mb": w["state_mb_at_start"],
                    f"{tag}_mb_moved": w["mb_moved"],
                    f"{tag}_mb_per_s": w["mb_per_s"],
                    f"{tag}_keys_moved": w["keys_moved"],
                    f"{tag}_keys_fetched": w["keys_fetched"],
                    f"{tag}_fetch_requests": w["fetch_requests"],
                    f"{tag}_records_parked": w["records_parked"],
                }
            )
        row["correct"] = r.get("correctness", {}).get("ok")
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct keys")
    parser.add_argument("--rate", type=float, help="source records/s (default: calibrated)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring")
    parser.add_argument("--steady", type=float, default=10.0, help="steady window seconds")
    parser.add_argument(
        "--distribution",
        choices=tuple(DISTRIBUTIONS),
        default="zipf",
        help="key distribution (with uniform keys a rescale moves about a third of the state)",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
    parser.add_argument(
        "--to", type=int, default=2, help="the scale-out's parallelism (1 -> TO -> 1)"
    )
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        help="standbys of the keyed stage in the strategy runs (a scale-out then starts no "
        "process in its window)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a strategy option for every rescale (e.g. subscales=0); repeatable",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "reports")
    parser.add_argument(
        "--sink-format",
        choices=("parquet", "none"),
        default="parquet",
        help="parquet enables the correctness check",
    )
    parser.add_argument(
        "--throughput-window",
        type=float,
        default=8.0,
        help="seconds per throughput measurement (0 skips the A/B)",
    )
    parser.add_argument(
        "--throughput-rounds", type=int, default=2, help="A/B rounds (old, new each)"
    )
    parser.add_argument(
        "--standby-rounds",
        type=int,
        default=0,
        help="only compare 1->2 with and without a standby, this many rounds (needs --rate)",
    )
    parser.add_argument(
        "--pacing-rounds",
        type=int,
        default=0,
        help="only compare a hot-first 1->2 unpaced and paced to --max-latency-ms, this many "
        "rounds of each, alternated (needs --rate)",
    )
    parser.add_argument(
        "--max-latency-ms", type=float, default=150.0, help="the paced runs' objective"
    )
    args = parser.parse_args()
    try:
        args.options = {k: float(v) for k, v in (o.split("=", 1) for o in args.option)}
    except ValueError:
        parser.error(f"--option takes NAME=NUMBER, got {args.option}")
    if args.to < 2:
        parser.error(f"--to must be at least 2, got {args.to}")
    comparisons = (("pacing", args.pacing_rounds, pacing_compare),
                   ("standby", args.standby_rounds, standby_compare))  # fmt: skip
    for name, rounds, compare in comparisons:
        if rounds > 0:
            if args.rate is None:
                parser.error(f"--{name}-rounds needs --rate")
            args.out_dir.mkdir(parents=True, exist_ok=True)
            return compare(
                args, args.rate, Path(tempfile.mkdtemp(prefix=f"keyshift-bench-{name}-"))
            )
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="keyshift-bench-rescale-"))
    load_at_start = os.getloadavg()
    say(
        f"work dir {root} (removed at the end unless a run fails); load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    throughput = None
    if args.throughput_window > 0 and args.throughput_rounds > 0:
        say(
            f"throughput A/B: bench/throughput.py pipeline at {BASELINE_COMMIT} (before live "
            f"rescaling) vs now, {args.throughput_rounds} rounds of {args.throughput_window:g} s"
        )
        throughput = throughput_check(args.throughput_window, args.throughput_rounds, root)
        say(
            f"throughput: before {throughput['before_rescaling_records_per_s']:,} rec/s, now "
            f"{throughput['current_records_per_s']:,} rec/s ({throughput['current_vs_before']:.1%})"
        )
    calibration = None
    rate = args.rate
    if rate is None:
        say("calibrating: the same job at full speed")
        calibration = calibrate(args.keys, args.sink_format, args.distribution, root)
        rate = round(LOAD_SHARE * calibration["full_speed_records_per_s"])
        calibration["rate"] = rate
        say(
            f"calibration: {calibration['full_speed_records_per_s']:,} rec/s at full speed "
            f"(keyed busy {calibration['keyed_busy']:.0%}) -> R = {LOAD_SHARE} x = {rate:,} "
            "rec/s"
        )
    reports = [run_strategy(s, args, float(rate), root) for s in strategies]
    check_correctness(reports, args.keys, args.distribution)
    for r in reports:
        if "correctness" in r:
            c = r["correctness"]
            say(
                f"{r['strategy']}: correct={c['ok']} (emitted {c['emitted']:,}, sum n "
                f"{c['output_n_sum']:,}, wrong keys {c['keys_wrong']})"
            )
    targets = evaluate(reports, throughput)
    result = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in load_at_start],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "config": {
            "keys": args.keys,
            "distribution": args.distribution,
            "zipf_exponent": 1.0,
            "seed": SEED,
            "batching": BATCHING,
            "rate": rate,
            "load_share": LOAD_SHARE,
            "warmup_s": args.warmup,
            "steady_s": args.steady,
            "sink_format": args.sink_format,
            "strategies": strategies,
            "scale_out_to": args.to,
            "options": args.options,
            "rescale_window_tail_s": WINDOW_TAIL,
        },
        "calibration": calibration,
        "throughput_check": throughput,
        "summary": summary_rows(reports),
        "targets": targets,
        "strategies": reports,
    }
    json_path = args.out_dir / "rescale.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(reports, args.keys, args.distribution, args.steady, args.out_dir / "rescale.png")
    print(json.dumps({"summary": result["summary"], "targets": targets}, indent=2))
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        print(f"[{verdict}] {t['target']}: {t['detail']}")
    failed = [r["strategy"] for r in reports if "error" in r]
    wrong = [r["strategy"] for r in reports if not r.get("correctness", {}).get("ok", True)]
    if not failed:
        shutil.rmtree(root, ignore_errors=True)
    say(f"wrote {json_path} and {args.out_dir / 'rescale.png'}")
    if failed or wrong:
        print(f"failed runs: {failed}; wrong output: {wrong}; logs under {root}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
