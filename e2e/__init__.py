"""The kind end-to-end suite: `pytest e2e -m e2e -v` (see e2e/README.md); not in `make test`."""
