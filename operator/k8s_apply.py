"""Server-side apply of the objects a StreamingJob owns, and who owns which of their fields.

The operator applies each child (`k8s_children`) as a whole configuration under its own field
manager, `keyshift-operator`, forced (it is the only writer of those fields): the API server
merges it into the live object and removes what the operator applied before and leaves out now,
so a field dropped from `podTemplate` disappears from the live pods' templates. Other writers'
fields (a `kubectl annotate`, a mutating webhook's) are kept.

A StatefulSet's `spec.replicas` belongs to a second manager, `keyshift-scaler`: the rescale and
autoscaling path (`k8s_scaling.StatefulSetPool`) writes it, and the operator's configuration
leaves it out once the StatefulSet exists. This is Kubernetes' practice for a field a controller
such as the HPA changes: two appliers of one field fight (each apply sets its own value back),
and an applier that simply stops giving a field it owned removes it (the StatefulSet would drop
to one replica). So the first apply, which creates the StatefulSet, gives the stage's initial
parallelism, and the operator then hands the field over by applying it, same value, as the
scaler (`apply_replicas`): from then on the scaler alone owns it. A third manager,
`keyshift-restarter`, owns one annotation of the coordinator's pod template, which it changes
to restart a failed job (`restart_deployment`, as `kubectl rollout restart`). Used by
`keyshift.operator.k8s_operator` and `keyshift.operator.k8s_scaling`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client as k8s

from keyshift.operator.k8s_children import MANAGER

APPLY_PATCH = "application/apply-patch+yaml"
SCALER = "keyshift-scaler"
RESTARTER = "keyshift-restarter"
RESTARTED_AT = "keyshift.io/restartedAt"


async def apply(api: k8s.ApiClient, manifest: Mapping[str, Any], manager: str = MANAGER) -> None:
    """Server-side apply `manifest` (created if missing) as `manager`, taking over conflicting
    fields (force)."""
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    networking, policy = k8s.NetworkingV1Api(api), k8s.PolicyV1Api(api)
    patches: dict[str, Any] = {
        "ConfigMap": core.patch_namespaced_config_map,
        "Secret": core.patch_namespaced_secret,
        "Service": core.patch_namespaced_service,
        "Deployment": apps.patch_namespaced_deployment,
        "StatefulSet": apps.patch_namespaced_stateful_set,
        "NetworkPolicy": networking.patch_namespaced_network_policy,
        "PodDisruptionBudget": policy.patch_namespaced_pod_disruption_budget,
    }
    metadata = manifest["metadata"]
    await patches[manifest["kind"]](
        metadata["name"],
        metadata["namespace"],
        dict(manifest),
        field_manager=manager,
        force=True,
        _content_type=APPLY_PATCH,
    )


def scaler_owns_replicas(stateful_set: k8s.V1StatefulSet) -> bool:
    """Whether the live StatefulSet's replicas were handed to the scaler (they were not if the
    operator stopped between creating it and handing them over)."""
    return any(
        entry.manager == SCALER and "f:replicas" in (entry.fields_v1 or {}).get("f:spec", {})
        for entry in stateful_set.metadata.managed_fields or []
    )


async def apply_replicas(api: k8s.ApiClient, name: str, namespace: str, replicas: int) -> None:
    """Set the StatefulSet `name`'s replicas as the scaler, the one owner of that field."""
    config = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas},
    }
    await apply(api, config, SCALER)


async def restart_deployment(api: k8s.ApiClient, name: str, namespace: str, at: str) -> None:
    """Roll the Deployment `name`'s pods, as `kubectl rollout restart` does: a new annotation
    on its pod template (`at`, a time), owned by the restarter alone so the operator's own
    applies keep it."""
    config = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: at}}}},
    }
    await apply(api, config, RESTARTER)
