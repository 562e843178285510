"""Autoscaling simulation: DS2 against the threshold (HPA-like) baseline, no processes.

Runs every scenario of keyshift.policies.simulation (modelled jobs under step, ramp and sine
loads) with each policy and the guards, all at the default settings, and prints a Markdown
table: decisions to converge after each load change, overshoot, reversals under stationary
load, rescales per hour, instances, backlog. Then whether DS2 meets the target: at the optimum
within 3 decisions after every step, and no reversal under stationary load, on the scenarios
whose load DS2's model describes. Deterministic; takes a few seconds.
Run: `make bench-autoscaling` or `.venv/bin/python bench/autoscaling_sim.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Literal

from keyshift.policies.settings import AutoscalerSettings
from keyshift.policies.simulation import (
    CONVERGE_WITHIN,
    ChangeResult,
    RunResult,
    Scenario,
    scenarios,
    simulate,
    target_problems,
)

POLICIES: tuple[Literal["ds2", "threshold"], ...] = ("ds2", "threshold")


def converge_cell(changes: tuple[ChangeResult, ...]) -> str:
    """Decisions to converge after each load change, in order; ✗: not at the optimum when the
    next change came; —: the load never settles (sine)."""
    cells = []
    for c in changes:
        if not c.stationary:
            cells.append("—")
        elif c.decisions_to_converge is None:
            cells.append("✗")
        else:
            cells.append(str(c.decisions_to_converge))
    return " · ".join(cells)


def change_list(scenario: Scenario) -> str:
    return " · ".join(f"{c.kind} {c.start:g} s" for c in scenario.load.changes())


def table(results: list[tuple[Scenario, RunResult]]) -> str:
    rows = [
        "| scenario | policy | decisions to converge | overshoot | reversals (stationary) "
        "| rescales/h | mean instances | time backlogged | max lag |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, r in results:
        stationary = any(c.stationary for c in r.changes)
        rows.append(
            f"| {scenario.name}{'' if scenario.ds2_assumptions_hold else ' *'} | {r.policy} "
            f"| {converge_cell(r.changes)} "
            f"| {r.max_overshoot if stationary else '—'} "
            f"| {r.stationary_reversals if stationary else '—'} "
            f"| {r.rescales_per_hour:.1f} | {r.mean_instances:.2f} "
            f"| {r.backlogged:.1%} | {r.max_lag:.0f} s |"
        )
    return "\n".join(rows)


def scenario_table(suite: tuple[Scenario, ...]) -> str:
    rows = ["| scenario | job and load | load changes (decisions are counted per change) |",
            "|---|---|---|"]  # fmt: skip
    for s in suite:
        name = s.name if s.ds2_assumptions_hold else f"{s.name} *"
        rows.append(f"| {name} | {s.description}; {s.load.describe()} | {change_list(s)} |")
    return "\n".join(rows)


def settings_line(settings: AutoscalerSettings) -> str:
    names = ("interval", "metrics_window", "warmup", "activation", "scale_down_activation",
             "change_threshold", "target_utilization", "catch_up", "scale_up_busy",
             "scale_down_busy")  # fmt: skip
    values = ", ".join(f"{n}={getattr(settings, n)}" for n in names)
    b = settings.bounds
    return f"{values}, bounds=[{b.min_parallelism}, {b.max_parallelism}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", action="append", help="only these (repeatable)")
    parser.add_argument("--noise", type=float, help="measurement noise for every scenario")
    parser.add_argument("--seed", type=int, help="noise seed for every scenario")
    parser.add_argument("--trace", action="store_true", help="also print every rescale")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    suite = scenarios()
    if args.scenario:
        unknown = set(args.scenario) - {s.name for s in suite}
        if unknown:
            parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
        suite = tuple(s for s in suite if s.name in args.scenario)
    if args.noise is not None:
        suite = tuple(dataclasses.replace(s, noise=args.noise) for s in suite)
    if args.seed is not None:
        suite = tuple(dataclasses.replace(s, seed=args.seed) for s in suite)
    results = [
        (scenario, simulate(scenario, AutoscalerSettings(policy=policy)))
        for scenario in suite
        for policy in POLICIES
    ]
    print(f"Settings (defaults): {settings_line(AutoscalerSettings())}\n")
    print(scenario_table(suite) + "\n")
    print(table(results) + "\n")
    print("* outside DS2's model: reported, not part of the target.\n")
    checked = [(s, r) for s, r in results if r.policy == "ds2" and s.ds2_assumptions_hold]
    failures = {s.name: target_problems(r) for s, r in checked if target_problems(r)}
    met = not failures
    steps = sum(c.change.kind in ("start", "step") for _, r in checked for c in r.changes)
    if not checked:
        print("Target: not checked (no scenario within DS2's model selected)")
    else:
        print(
            f"Target (DS2 converges within {CONVERGE_WITHIN} decisions after every step and never "
            f"reverses under stationary load; {steps} steps, counting each start, in "
            f"{len(checked)} scenarios): {'met' if met else 'NOT met'}"
        )
    for name, problems in failures.items():
        print(f"  {name}: {'; '.join(problems)}")
    for policy in POLICIES:
        for s, r in results:
            if r.policy == policy and not s.ds2_assumptions_hold:
                problems = target_problems(r)
                print(f"  {s.name} ({policy}, outside the target): "
                      f"{'; '.join(problems) if problems else 'would meet it'}")  # fmt: skip
    baseline = [r for s, r in results if r.policy == "threshold" and s.ds2_assumptions_hold]
    baseline_fails = sum(1 for r in baseline if target_problems(r))
    print(f"  threshold baseline misses it on {baseline_fails} of {len(baseline)} scenarios")
    if args.trace:
        for s, r in results:
            print(f"\n{s.name} / {r.policy}:")
            for x in r.rescales:
                print(f"  {x.at:7.0f} s  {x.stage} {x.current}→{x.target}  {x.reason}")
    if args.json:
        data = {
            "settings": AutoscalerSettings().model_dump(),
            "target_met": met,
            "runs": [
                {
                    "scenario": s.name,
                    "policy": r.policy,
                    "ds2_assumptions_hold": s.ds2_assumptions_hold,
                    "decisions_to_converge": [c.decisions_to_converge for c in r.changes],
                    "max_overshoot": r.max_overshoot,
                    "stationary_reversals": r.stationary_reversals,
                    "rescales_per_hour": r.rescales_per_hour,
                    "mean_instances": r.mean_instances,
                    "mean_backlog": r.mean_backlog,
                    "backlogged": r.backlogged,
                    "max_lag_s": r.max_lag if math.isfinite(r.max_lag) else None,
                    "target_problems": target_problems(r),
                    "rescales": [dataclasses.asdict(x) for x in r.rescales],
                }
                for s, r in results
            ],
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
