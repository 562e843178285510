# syntax=docker/dockerfile:1.7
# The keyshift image: the runtime (coordinator, stage instances), the operator and the CLI.
#
#   docker build -t keyshift:dev .
#
# Pods run it as the operator makes them (operator/k8s_children.py): `python -P -m
# keyshift.runtime.<coordinator|instance> ...` in /app, as uid/gid 10001, with a read-only root
# filesystem and /tmp as an emptyDir; the chart runs `keyshift operator`. Job code lives under
# /app (the working directory, from which `module:function` names are imported): the examples
# are there, so `examples.lookups:enrich` works as is. A job's own image starts FROM this one and
# copies its package into /app.
#
# The wheel holds every package of pyproject.toml's package-dir (keyshift.spark too, which needs
# the PySpark that only the Spark image installs): each must be copied below and let in by
# .dockerignore, which tests/test_build_context.py checks without Docker.
#
# Built by the kind end-to-end suite (e2e/) and its workflow, and by the release workflow;
# docker/spark.Dockerfile builds on it.
# Both stages use the same pinned base (bump them together).

# -- builder: wheels for keyshift and every dependency (no compiler needed: all have wheels) -----
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /build
# The dependencies first, from pyproject.toml alone: this layer is rebuilt only when they change.
COPY pyproject.toml ./
RUN python -P -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && pip wheel --wheel-dir /wheels --requirement requirements.txt
COPY README.md ./
COPY runtime ./runtime
COPY policies ./policies
COPY operator ./operator
COPY spark ./spark
RUN pip wheel --no-deps --wheel-dir /wheels .

# -- the image: the wheels installed from a bind mount, so none of them stays in a layer ---------
FROM python:3.11.13-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="keyshift" \
      org.opencontainers.image.description="Stateful stream processing that rescales live: runtime, operator and CLI" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.13-slim-bookworm"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 keyshift \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/keyshift \
        --shell /usr/sbin/nologin keyshift
# pip compiles the installed modules to bytecode here, so a read-only root filesystem costs no
# start-up time; the smoke import fails the build if a module is missing.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels /wheels/keyshift-*.whl \
 && python -P -c "import keyshift.runtime.coordinator, keyshift.runtime.instance, keyshift.operator.cli" \
 && keyshift --help > /dev/null
WORKDIR /app
COPY examples ./examples
RUN python -P -m compileall -q /app/examples
USER 10001:10001
CMD ["keyshift", "--help"]
