# Producer image for GPU inference nodes: the official vLLM build plus sparkforge.
# Build from the repo root:
#   docker build -f docker/producer.Dockerfile -t sparkforge-producer:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg GIT_SHA="$(git rev-parse HEAD)" .
# The base image already holds vLLM and its CUDA torch; this file only adds the sparkforge wheel
# (built in a throw-away stage, so no build tool lands in the final image) and a non-root user.
ARG VLLM_VERSION=0.33.0

FROM python:3.12.12-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY trainer ./trainer
COPY shared ./shared
COPY manifests ./manifests
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM vllm/vllm-openai:v${VLLM_VERSION}
ARG VLLM_VERSION
ARG VERSION=0.1.0
ARG GIT_SHA=unknown
# Extras installed with the wheel; tests/integration/test_images.py installs the same ones
# (with the CPU build of vLLM standing in for the producer extra).
ARG SPARKFORGE_EXTRAS=producer,s3,gcs
LABEL org.opencontainers.image.title="sparkforge-producer" \
      org.opencontainers.image.description="Capture target hidden states with vLLM into a sparkforge cache" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /dist /tmp/dist
# vLLM is pinned to the base image's own build so pip never swaps it (or its torch) out;
# dumb-init runs as PID 1 and passes SIGTERM on, so a preempted pod stops at once.
RUN python3 -m pip install --no-cache-dir \
        "$(find /tmp/dist -name 'sparkforge-*.whl')[${SPARKFORGE_EXTRAS}]" \
        "vllm==${VLLM_VERSION}" "dumb-init==1.2.5.post1" \
    && rm -rf /tmp/dist \
    && python3 -c "import sparkforge.app.cli, sparkforge.producer.run, vllm" \
    && useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin sparkforge
ENV HF_HOME=/home/sparkforge/.cache/huggingface \
    SPARKFORGE_VERSION=${VERSION} \
    SPARKFORGE_GIT_SHA=${GIT_SHA}
USER 10001:10001
WORKDIR /home/sparkforge
ENTRYPOINT ["dumb-init", "--", "sparkforge"]
CMD ["--help"]
