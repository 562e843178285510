"""keyshift's data plane: coordinator, stage instances, keyed state, batches and gRPC transport.

Imported by the operator package (local host, CLI) and by the processes it starts; it never
imports the operator.
"""
