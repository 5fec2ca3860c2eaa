# Trainer image for GPU training nodes: PyTorch + Lightning + sparkforge (non-editable, no vLLM).
# Build from the repo root: docker build -f docker/trainer.Dockerfile -t sparkforge-trainer .
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
WORKDIR /opt/sparkforge
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY trainer ./trainer
COPY shared ./shared
COPY manifests ./manifests
RUN pip install --no-cache-dir ".[trainer,s3,gcs]" \
    && python -c "import sys, sparkforge.trainer; assert 'vllm' not in sys.modules"
ENTRYPOINT ["sparkforge"]
CMD ["train", "--help"]
