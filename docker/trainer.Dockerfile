# Trainer image for GPU training nodes: PyTorch (CUDA) + Lightning + sparkforge, no vLLM.
# Build from the repo root:
#   docker build -f docker/trainer.Dockerfile -t sparkforge-trainer:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg GIT_SHA="$(git rev-parse HEAD)" .
# The wheel is built in a throw-away stage, so no build tool lands in the final image.
ARG TORCH_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

FROM python:3.12.12-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY trainer ./trainer
COPY shared ./shared
COPY manifests ./manifests
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${TORCH_IMAGE}
ARG VERSION=0.1.0
ARG GIT_SHA=unknown
# Extras installed with the wheel; tests/integration/test_images.py installs the same ones
# (with the CPU build of torch standing in for the base image's CUDA build).
ARG SPARKFORGE_EXTRAS=trainer,s3,gcs
LABEL org.opencontainers.image.title="sparkforge-trainer" \
      org.opencontainers.image.description="Train DSpark drafts from a sparkforge cache with Lightning" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /dist /tmp/dist
# torch comes from the base image (the extra's bare "torch" is already met, so pip keeps it);
# Lightning and transformers are pinned; dumb-init runs as PID 1 and passes SIGTERM on, so
# Lightning sees the preemption signal and a requeued run resumes from last.ckpt.
RUN python -m pip install --no-cache-dir \
        "$(find /tmp/dist -name 'sparkforge-*.whl')[${SPARKFORGE_EXTRAS}]" \
        "lightning==2.6.5" "transformers==5.19.0" "dumb-init==1.2.5.post1" \
    && rm -rf /tmp/dist \
    && python -c "import sys, sparkforge.app.cli, sparkforge.trainer.run; assert 'vllm' not in sys.modules" \
    && useradd --uid 10001 --no-log-init --create-home --shell /usr/sbin/nologin sparkforge
ENV SPARKFORGE_VERSION=${VERSION} \
    SPARKFORGE_GIT_SHA=${GIT_SHA}
USER 10001:10001
WORKDIR /home/sparkforge
ENTRYPOINT ["dumb-init", "--", "sparkforge"]
CMD ["--help"]
