# syntax=docker/dockerfile:1
# tracejudge: consume agent traces from Kafka, evaluate them, export quality to Prometheus.
#
#   docker build -t tracejudge:0.1.0 .
#   docker run --rm -p 9464:9464 tracejudge:0.1.0 --bootstrap-servers kafka:9092 --topic otlp_spans:otlp_proto
#
# The entrypoint is `tracejudge run`; arguments are its flags (`--config /etc/tracejudge/config.yaml`,
# `--topic NAME[:FORMAT]`, ...), and TRACEJUDGE_<SECTION>__<KEY> environment variables override the file.
# The same image runs the write-back sinks: entrypoint `tracejudge sink mlflow` (or `otlp`), same
# probes and port (deploy/compose/compose.yaml, deploy/k8s/sink-mlflow-deployment.yaml).
# Probes (HTTP on port 9464, the same server as /metrics):
#   /healthz  liveness: the poll loop turns            -> Kubernetes livenessProbe, the HEALTHCHECK below
#   /readyz   readiness: partitions assigned, broker up -> Kubernetes readinessProbe
# SIGTERM drains in-flight records and commits (stream.shutdown_grace_seconds), so give the container
# a longer stop timeout (compose stop_grace_period, Kubernetes terminationGracePeriodSeconds).
# The judge API key is read from a file (judges.endpoints.<name>.api_key_file, a mounted secret) or from
# the environment variable named by api_key_env; it is never baked into the image.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- build: a virtual environment with tracejudge and its runtime dependencies (wheels only) ---------
FROM ${PYTHON_IMAGE} AS build
# EXTRAS="[demo]" adds the embedded demo (bundled broker, MLflow-traced agent); production leaves it empty.
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/ api/
COPY consumer/ consumer/
COPY metrics/ metrics/
COPY schemas/ schemas/
# Every dependency ships manylinux wheels, so the slim image needs no compiler. pip itself is removed
# from the environment: nothing installs at run time.
RUN python -m venv /opt/tracejudge \
 && /opt/tracejudge/bin/pip install --no-cache-dir ".${EXTRAS}" \
 && /opt/tracejudge/bin/pip uninstall --yes pip

# --- runtime: the interpreter, the virtual environment, an unprivileged user ------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="tracejudge" \
      org.opencontainers.image.description="Evaluate LLM agent traces from Kafka and export quality to Prometheus" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 tracejudge \
 && useradd --system --uid 10001 --gid tracejudge --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin tracejudge
COPY --from=build /opt/tracejudge /opt/tracejudge
# glibc malloc: kafka-python assembles each fetch response (up to 1 MiB) in fresh buffers, which by
# default come from mmap and are zero-filled page by page every time (~14 page faults per 22 KB
# record). Serving them from the heap instead, and keeping up to 64 MiB of freed heap, measured +20%
# records/s for `tracejudge run` (bench/bench_stream.py, docs/pages/benchmarks.md), at the cost of that
# much retained memory at most.
ENV PATH=/opt/tracejudge/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=8388608:glibc.malloc.trim_threshold=67108864
WORKDIR /tmp
USER 10001:10001
EXPOSE 9464
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tracejudge", "run"]
CMD ["--config", "/etc/tracejudge/config.yaml"]
