"""Job files that would exhaust or mislead the reader (keyshift.runtime.job_file) and user
functions with the wrong signature are refused up front: `load_job` raises JobError naming the
limit or the key and line, and `keyshift run` exits 2 with that message, starting nothing.
Also the exit codes the README documents for `keyshift rescale`."""

from __future__ import annotations

import re
import resource
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime import job_file
from keyshift.runtime.job import JobError, load_job, parse_job
from tests.conftest import count_job, keyshift_main, running_job, wait_for


def billion_laughs() -> str:
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        text += f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]\n"
    return text + "name: laughs\n"


HOSTILE = {
    "deep-flow": ("name: x\nfields: " + "[" * 5000 + "]" * 5000 + "\n", "nesting deeper than 32"),
    "deep-block": (
        "name: x\nfields:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)),
        "nesting deeper than 32",
    ),
    "laughs": (billion_laughs(), "more than 100,000 values once aliases are expanded"),
    "deep-aliases": (
        "a: &a [[[[[[[[[[1]]]]]]]]]]\nb: &b [[[[[[[[[[*a]]]]]]]]]]\nc: &c [[[[[[[[[[*b]]]]]]]]]]\n"
        "d: [[[[[[[[[[*c]]]]]]]]]]\nname: x\n",
        "nesting deeper than 32 levels once aliases are expanded",
    ),
    "recursive": ("a: &a [*a]\nname: x\n", "an alias refers to a node that contains it"),
    "duplicate": (
        "name: x\nkeyed:\n  name: counts\n  parallelism: 2\n  parallelism: 3\n",
        "found duplicate key 'parallelism' (first on line 4)",
    ),
    "big": ("name: x\n" + "# padding\n" * 120_000, "larger than 1,048,576 bytes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_job_files_are_refused_quickly_and_cheaply(tmp_path: Path, case: str) -> None:
    text, message = HOSTILE[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(JobError, match=re.escape(message)) as caught:
        load_job(path)
    assert str(path) in str(caught.value)
    # ru_maxrss is in KiB: reading one must not grow this process by more than 50 MB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000


def test_the_duplicate_key_error_names_the_line_of_the_second(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(HOSTILE["duplicate"][0])
    with pytest.raises(JobError, match=r"line 5, column 3"):
        load_job(path)


def test_merge_keys_may_override_and_limits_leave_real_jobs_alone(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("name: merged\nkeyed: {<<: {name: counts, parallelism: 1}, parallelism: 3}\n")
    assert load_job(path).keyed.parallelism == 3
    points = [[t, 100.0] for t in range(20_000)]  # a long but honest profile
    path.write_text(
        "name: long\nsource: {config: {profile: {kind: points, points: " + str(points) + "}}}\n"
    )
    assert path.stat().st_size < job_file.MAX_BYTES
    assert len(load_job(path).source.config.profile.points) == 20_000  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("where", "function", "message"),
    [
        ("map", "os:system", "'os:system' is a built-in function; keyshift calls it with one"),
        ("filter", "builtins:len", "is a built-in function"),
        ("map", "tests.job_fns:track", "keyshift calls it with one argument"),
        ("process", "copy:copy", "keyshift calls it with two arguments (state, record)"),
        ("sink", "builtins:divmod", "keyshift calls it with one argument"),
    ],
)
def test_functions_with_the_wrong_signature_are_refused(
    where: str, function: str, message: str
) -> None:
    places: dict[str, dict[str, Any]] = {
        "map": {"source": {"transforms": [{"map": function}]}},
        "filter": {"source": {"transforms": [{"filter": function}]}},
        "process": {"keyed": {"operator": {"kind": "process", "function": function}}},
        "sink": {"sink": {"config": {"kind": "function", "function": function}}},
    }
    job = {"name": "sig", "fields": {"key": "int", "value": "float"}, **places[where]}
    with pytest.raises(JobError, match=re.escape(message)):
        parse_job(job)
    parse_job(job, resolve_functions=False)  # the operator checks the form only


def test_keyshift_run_refuses_hostile_files_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process, not marked live: starting anything would fail the test."""
    cases = {**HOSTILE, "system": ("name: x\nsource: {transforms: [{map: 'os:system'}]}\n", "")}
    for case, (text, message) in cases.items():
        path = tmp_path / f"{case}.yaml"
        path.write_text(text)
        code, output = keyshift_main(["run", str(path), "--no-view"], capsys)
        assert code == 2, (case, output)
        assert "Traceback" not in output and message.split(" (")[0] in " ".join(output.split())


@pytest.mark.live
@pytest.mark.slow
def test_rescale_exit_codes_match_the_readme(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = keyshift_main(["rescale", "127.0.0.1:1", "counts", "0"], capsys)
    assert code == 2 and "parallelism must be at least 1" in output
    job = count_job(source={"config": {"kind": "generator", "keys": 100, "profile": {"rate": 500}}})
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 60, "the job to run")
        for args, message in (
            (["no-such-stage", "2"], "has no stage 'no-such-stage'"),
            (["counts", "2", "--option", "batch_groups=-1"], "batch_groups"),
        ):
            code, output = keyshift_main(["rescale", local.address, *args], capsys)
            assert code == 2, output  # refused: README says 2
            assert message in output
        status = local.status()
        assert status["phase"] == "running" and status["stages"][1]["parallelism"] == 2
        assert status["rescales"] == []  # refused requests change nothing


def test_job_data_from_elsewhere_is_held_to_the_same_limits() -> None:
    # A StreamingJob's spec or a registration reply arrives as JSON, not as a file.
    deep: dict[str, object] = {}
    for _ in range(5000):
        deep = {"k": deep}
    wide = {"endpoint": "x", "options": [[1, 2, 3]] * 40_000}
    for data, message in ((deep, "nesting deeper than 32 levels"), (wide, "more than 100,000")):
        job = {"name": "x", "checkpoints": {"storage_options": data}}
        with pytest.raises(JobError, match=f"invalid job spec.job: {message}"):
            parse_job(job, origin="spec.job", resolve_functions=False)
