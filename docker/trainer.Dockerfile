# A trainer (torch) that runs the README's examples under plans fetched from the planner service.
#   docker build -f docker/trainer.Dockerfile -t dcp-trainer:cpu .                          # CPU torch
#   docker build -f docker/trainer.Dockerfile --build-arg TORCH_VARIANT=cu128 -t dcp-trainer:cu128 .
#   docker run --network host dcp-trainer:cpu \
#       torchrun --nproc_per_node 4 examples/train_1d.py --url http://127.0.0.1:8000 --steps 4
# TORCH_VARIANT picks the wheel index of the pinned torch: cpu, or a CUDA build such as cu128
# (CUDA wheels bring their own CUDA libraries; the host needs the NVIDIA driver and container toolkit).
FROM python:3.11-slim

# Keep TORCH_VERSION equal to the torch pin in pyproject.toml (a test checks it).
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY costmodel ./costmodel
COPY planner ./planner
COPY api ./api
COPY executor ./executor
COPY ingest ./ingest
COPY report ./report
COPY dcp_cli ./dcp_cli
COPY examples ./examples
# The pinned torch above satisfies the torch extra, so pip keeps it (no second download).
# DL3013 takes the local project with its extra for an unpinned package.
# hadolint ignore=DL3013
RUN pip install ".[torch]" \
    && useradd --system --uid 10001 dcp
USER 10001
CMD ["torchrun", "--nproc_per_node", "4", "examples/train_1d.py", "--url", "http://127.0.0.1:8000", "--steps", "4"]
