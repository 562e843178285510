# syntax=docker/dockerfile:1.7
# The Spark image: the keyshift image plus a JRE and PySpark, for the PySpark sources and sinks a
# StreamingJob runs (`spec.sources` / `spec.sinks`: one Deployment each, running
# `spark-submit --master local[*] <script>` as uid 10001 with a read-only root filesystem and
# /tmp as an emptyDir; see operator/k8s_children.py). Build the keyshift image first:
#
#   docker build -t keyshift:dev .
#   docker build -f docker/spark.Dockerfile --build-arg KEYSHIFT_IMAGE=keyshift:dev \
#       -t keyshift-spark:dev .
#
# It inherits /app (the working directory) and the examples in /app/examples from the keyshift
# image, so Spark scripts kept in examples/ (examples/spark/) are in both images.

ARG KEYSHIFT_IMAGE=ghcr.io/keyshift/keyshift:0.1.0
FROM ${KEYSHIFT_IMAGE}
ARG PYSPARK_VERSION=4.3.0
LABEL org.opencontainers.image.title="keyshift-spark" \
      org.opencontainers.image.description="keyshift with PySpark ${PYSPARK_VERSION} and a Java 17 runtime, for keyshift's Spark sources and sinks"

USER 0:0
# Debian's slim images have no man directories, which the JRE's postinst expects; procps gives
# Spark's scripts `ps`. A stable JAVA_HOME whatever the architecture: /usr/lib/jvm/java-17.
# The Debian packages are not pinned: the base image pins the release (bookworm), whose
# security updates replace the exact versions.
# hadolint ignore=DL3008
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s "java-17-openjdk-$(dpkg --print-architecture)" /usr/lib/jvm/java-17 \
 && /usr/lib/jvm/java-17/bin/java -version
ENV JAVA_HOME=/usr/lib/jvm/java-17 \
    SPARK_CONF_DIR=/etc/spark \
    PYSPARK_PYTHON=python3 \
    PYSPARK_DRIVER_PYTHON=python3
# Spark writes only below /tmp (the pods' emptyDir): scratch space, the SQL warehouse, the Ivy
# cache; nothing under the read-only root filesystem.
RUN mkdir -p /etc/spark \
 && printf '%s\n' \
      'spark.local.dir /tmp/spark-local' \
      'spark.sql.warehouse.dir /tmp/spark-warehouse' \
      'spark.jars.ivy /tmp/.ivy2' \
      'spark.ui.showConsoleProgress false' \
      > /etc/spark/spark-defaults.conf
RUN pip install --no-cache-dir "pyspark==${PYSPARK_VERSION}" \
 && spark-submit --version
USER 10001:10001
CMD ["spark-submit", "--version"]
