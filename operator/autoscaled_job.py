"""The job as the hosts load it: the runtime's `JobSpec` with its `autoscaler` section parsed
into the policies' `AutoscalerSettings` and checked against the job's stages.

The runtime carries that section unread (it imports no policy types), so every host loads a job
through this model: `keyshift run` (`load_job_as(AutoscaledJob, path)`, before it starts
anything), the StreamingJob's `job_spec()` on Kubernetes, and the CRD generator, whose schema
of `spec.job` comes from it. Errors read as every other job error (`invalid job ...:` with the
field).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from keyshift.policies.settings import AutoscalerSettings
from keyshift.runtime.job import JobSpec

_CHAINED = "map and filter stages run in their source's processes and scale with it"


class AutoscaledJob(JobSpec):
    """A JobSpec whose autoscaler section is `AutoscalerSettings` (or none)."""

    autoscaler: AutoscalerSettings | None = Field(
        default=None, description="pick the parallelism by itself; none keeps it as given"
    )

    @model_validator(mode="after")
    def _autoscaler_fits(self) -> AutoscaledJob:
        if self.autoscaler is None:
            return self
        names = [stage.name for stage in self.stages()]
        unknown = sorted(set(self.autoscaler.stages) - set(names))
        if unknown:
            chained = f" ({_CHAINED})" if self.graph is not None else ""
            raise ValueError(
                f"autoscaler.stages names {unknown}, which are not stages {names}{chained}"
            )
        for step in self.keyed_stages():
            name = step.stage.name
            ceiling = self.autoscaler.bounds_of(name).max_parallelism
            if ceiling > self.max_key_groups:
                raise ValueError(
                    f"the autoscaler's max_parallelism for {name} ({ceiling}) must "
                    f"not exceed max_key_groups ({self.max_key_groups})"
                )
        return self
