"""The migration strategy has one place in a StreamingJob, spec.migration (with its options):
spec.job.autoscaler.strategy is a deprecated alias that still works alone and is refused when
it disagrees. The operator's warning about the alias is tested in
tests/test_control_plane_restarts.py."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.operator.streamingjob import StreamingJobSpec


@pytest.mark.parametrize(
    ("migration", "alias", "strategy", "deprecated"),
    [
        ({}, None, "hot-first", False),
        ({"strategy": "lazy"}, None, "lazy", False),
        ({}, "batched", "batched", True),  # the deprecated alias alone still works
        ({"strategy": "lazy"}, "lazy", "lazy", True),
    ],
)
def test_spec_migration_is_the_one_place_of_the_strategy(
    migration: dict[str, Any], alias: str | None, strategy: str, deprecated: bool
) -> None:
    job: dict[str, Any] = {"name": "clicks"}
    if alias is not None:
        job["autoscaler"] = {"strategy": alias}
    spec = StreamingJobSpec.model_validate({"image": "x", "job": job, "migration": migration})
    assert spec.strategy() == strategy and spec.problems() == []
    assert bool(spec.deprecations()) == deprecated
    if deprecated:
        assert "set spec.migration.strategy" in spec.deprecations()[0]


def test_a_strategy_set_apart_in_the_two_places_is_refused() -> None:
    spec = StreamingJobSpec.model_validate({
        "image": "x",
        "job": {"name": "clicks", "autoscaler": {"strategy": "lazy"}},
        "migration": {"strategy": "batched", "options": {"batch_groups": 64}},
    })  # fmt: skip
    assert spec.problems() == [
        "spec.job.autoscaler.strategy (lazy) disagrees with spec.migration.strategy (batched): "
        "one strategy applies to every rescale; set it in spec.migration.strategy only"
    ]
    # Options are checked against the strategy that applies, the alias's when it is alone.
    aliased = StreamingJobSpec.model_validate({
        "image": "x",
        "job": {"name": "clicks", "autoscaler": {"strategy": "lazy"}},
        "migration": {"options": {"batch_groups": 64}},
    })  # fmt: skip
    assert "'batch_groups' does not apply to lazy" in aliased.problems()[0]


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"handover": 0}, None),  # hand-over from checkpoints off
        ({"handover": 1, "batch_groups": 64}, None),
        ({"handover": 0.5}, "option 'handover' must be 1"),
        ({"chunk_keys": 0}, "option 'chunk_keys' must be a positive number"),
    ],
)
def test_spec_migration_options_take_the_handover_switch(
    options: dict[str, float], problem: str | None
) -> None:
    spec = StreamingJobSpec.model_validate({
        "image": "x",
        "job": {"name": "clicks"},
        "migration": {"strategy": "batched", "options": options},
    })  # fmt: skip
    problems = spec.problems()
    assert problems == [] if problem is None else problem in problems[0], problems
