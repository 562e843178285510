"""Pure scaling policies (DS2 and baselines): no I/O, no clock reads, `now` passed in.

Imports nothing else of keyshift's; the control loop in keyshift.operator and the simulation in
bench/ call them. `make_policy` picks the one a job's settings name.
"""

from __future__ import annotations

from keyshift.policies.ds2 import DS2Policy
from keyshift.policies.model import Policy
from keyshift.policies.settings import AutoscalerSettings
from keyshift.policies.threshold import ThresholdPolicy


def make_policy(settings: AutoscalerSettings) -> Policy:
    if settings.policy == "ds2":
        return DS2Policy(settings)
    return ThresholdPolicy(settings)
