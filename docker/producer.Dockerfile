# Producer image for GPU inference nodes: the official vLLM build plus sparkforge (non-editable).
# Build from the repo root: docker build -f docker/producer.Dockerfile -t sparkforge-producer .
FROM vllm/vllm-openai:v0.33.0
WORKDIR /opt/sparkforge
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY trainer ./trainer
COPY shared ./shared
COPY manifests ./manifests
# vLLM (and its torch) come from the base image; pin them rather than letting pip re-resolve.
RUN pip install --no-cache-dir ".[s3,gcs]" "vllm==0.33.0" \
    && python -c "import sparkforge.app.cli, sparkforge.producer.run, vllm; print(vllm.__version__)"
ENV HF_HUB_OFFLINE=1
ENTRYPOINT ["sparkforge"]
CMD ["produce", "--help"]
