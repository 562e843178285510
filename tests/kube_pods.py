"""A test-side kubelet: runs real keyshift processes on loopback for the coordinator Deployments
and stage StatefulSets it finds in the API emulator, and reports their replicas ready.

What a cluster gives and loopback cannot, it translates: each pod's fixed ports become free
ports, `$(POD_IP)` becomes 127.0.0.1, a coordinator Service's DNS name becomes the loopback
address its pod listens on (`address`, which the operator's config uses too), a StatefulSet
pod's hostname is set for `--index hostname`, a Deployment's pod is replaced when its template
changes (a rollout, as `kubectl rollout restart` makes one), ConfigMap volumes are written to a
directory, and variables from Secrets (`secretKeyRef`: the job's secret) are read from the
stored Secrets.
Spark source/sink Deployments are not run (they need the PySpark issue). `delete` removes a pod
as `kubectl delete pod` does (its workload makes it again at once). Every process it starts
is stopped by `stop`. Used by tests/test_k8s_operator.py.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

from keyshift.operator.k8s_children import COORDINATOR_PORT, LABEL_COMPONENT
from keyshift.operator.processes import Child
from tests.kube_emulator import Emulator, listed, stored
from tests.prometheus_server import free_port

SERVICE_ADDRESS = re.compile(r"^([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)$")
FIXED_PORT_FLAGS = ("--port", "--metrics-port")
RESTART_BACKOFF = 10.0


class PodRunner:
    def __init__(self, emu: Emulator, namespace: str, workdir: Path) -> None:
        self.emu = emu
        self.namespace = namespace
        self.workdir = workdir
        self.pods: dict[str, Child] = {}
        self._service_ports: dict[str, int] = {}
        self._exited: dict[str, float] = {}
        self._templates: dict[str, str] = {}  # each pod's template, as it was started

    def address(self, name: str, namespace: str) -> str:
        """Where the job's coordinator listens: fixed before its pod starts."""
        return f"127.0.0.1:{self._port_for(f'{name}-coordinator')}"

    def _port_for(self, service: str) -> int:
        if service not in self._service_ports:
            self._service_ports[service] = free_port()
        return self._service_ports[service]

    async def sync(self) -> None:
        """One pass: start missing pods, stop surplus ones, report readiness."""
        for kind, resource in (("deployment", "apps/v1/deployments"),
                               ("statefulset", "apps/v1/statefulsets")):  # fmt: skip
            for workload in listed(self.emu, resource, self.namespace):
                component = workload["spec"]["template"]["metadata"]["labels"].get(LABEL_COMPONENT)
                if component not in ("coordinator", "stage"):
                    continue
                await self._sync_workload(kind, resource, workload)

    async def _sync_workload(self, kind: str, resource: str, workload: dict[str, Any]) -> None:
        name = workload["metadata"]["name"]
        replicas = int(workload["spec"].get("replicas", 1))
        pod_names = [f"{name}-{i}" for i in range(replicas)]
        template = json.dumps(workload["spec"]["template"], sort_keys=True)
        for pod in pod_names:
            child = self.pods.get(pod)
            if child is not None and kind == "deployment" and self._templates[pod] != template:
                child.stop(grace=3.0)  # a rollout (strategy Recreate): the old pod goes first
                child = None
            if child is None or self._restart_due(pod, child):
                self.pods[pod] = self._start(pod, workload)
                self._templates[pod] = template
        prefix = f"{name}-"
        for pod in [p for p in self.pods if p.startswith(prefix) and p not in pod_names]:
            if pod[len(prefix) :].isdigit():
                self.pods.pop(pod).stop(grace=3.0)
        ready = sum(1 for p in pod_names if p in self.pods and self.pods[p].exit_code() is None)
        current = stored(self.emu, resource, self.namespace, name) or {}
        if current.get("status", {}).get("readyReplicas") != ready:
            await self.emu.patch(
                f"/apis/apps/v1/namespaces/{self.namespace}/{kind}s/{name}/status",
                json={"status": {"replicas": replicas, "readyReplicas": ready}},
                headers={"Content-Type": "application/merge-patch+json"},
            )

    def delete(self, pod: str) -> None:
        """`kubectl delete pod`: its process stops, and its workload's controller makes a new
        pod at the next sync, at once (a new pod, not a container restarted after a back-off)."""
        self.pods.pop(pod).stop(grace=3.0)
        self._exited.pop(pod, None)

    def _restart_due(self, pod: str, child: Child) -> bool:
        """Like the kubelet, restart an exited container, after a back-off (a retired instance
        exits before its StatefulSet shrinks, and must not be restarted at once)."""
        if child.exit_code() is None:
            return False
        first = self._exited.setdefault(pod, time.monotonic())
        if time.monotonic() - first < RESTART_BACKOFF:
            return False
        del self._exited[pod]
        child.stop(grace=0)
        return True

    def _start(self, pod: str, workload: dict[str, Any]) -> Child:
        template = workload["spec"]["template"]["spec"]
        container = template["containers"][0]
        mounts = self._mount(pod, template, container)
        command = [*container.get("command", []), *container.get("args", [])]
        while command and command[0] in ("python", "python3", "-P"):
            command.pop(0)
        args = [self._translate(arg, mounts) for arg in command]
        for flag in FIXED_PORT_FLAGS:
            if flag in args:
                i = args.index(flag)
                is_coordinator_port = args[i + 1] == str(COORDINATOR_PORT) and flag == "--port"
                owner = workload["metadata"]["name"]
                args[i + 1] = str(self._port_for(owner)) if is_coordinator_port else "0"
        env = {"HOSTNAME": pod, **self._secret_env(container)}
        return Child(pod, args, self.workdir / "logs" / f"{pod}.log", env=env)

    def _secret_env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's variables from `secretKeyRef`s, read from the stored Secrets; a
        missing Secret or key fails, as the kubelet would not start the container."""
        env = {}
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            secret = stored(self.emu, "v1/secrets", self.namespace, ref["name"])
            data = (secret or {}).get("data", {})
            assert ref["key"] in data, f"no key {ref['key']} in Secret {ref['name']}"
            env[entry["name"]] = base64.b64decode(data[ref["key"]]).decode()
        return env

    def _translate(self, arg: str, mounts: dict[str, Path]) -> str:
        arg = arg.replace("$(POD_IP)", "127.0.0.1")
        if arg == "0.0.0.0":
            return "127.0.0.1"
        match = SERVICE_ADDRESS.match(arg)
        if match:
            return f"127.0.0.1:{self._port_for(match.group(1))}"
        for mount_path, local in mounts.items():
            if arg.startswith(mount_path + "/"):
                return str(local / arg[len(mount_path) + 1 :])
        return arg

    def _mount(
        self, pod: str, template: dict[str, Any], container: dict[str, Any]
    ) -> dict[str, Path]:
        volumes = {v["name"]: v for v in template.get("volumes", [])}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "configMap" not in volume:
                continue
            config = stored(self.emu, "v1/configmaps", self.namespace, volume["configMap"]["name"])
            local = self.workdir / "volumes" / pod / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for key, text in (config or {}).get("data", {}).items():
                (local / key).write_text(text)
            mounts[mount["mountPath"]] = local
        return mounts

    def stop(self) -> None:
        for child in self.pods.values():
            child.stop(grace=3.0)
        self.pods.clear()
