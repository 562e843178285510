"""keyshift's control plane: the local host, the CLI and (later) the autoscaling loop and the
Kubernetes operator. It drives the runtime; the runtime never imports it.
"""
