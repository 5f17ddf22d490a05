# An example trainer (torch) that runs under plans fetched from the planner service.
#   docker build -f docker/trainer.Dockerfile -t dcp-trainer .
#   docker run --network host dcp-trainer \
#       torchrun --nproc_per_node 4 examples/train_1d.py --url http://127.0.0.1:8000 --steps 4
# The build installs the pinned torch from PyPI; for GPUs use a CUDA base image instead.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY costmodel ./costmodel
COPY planner ./planner
COPY api ./api
COPY executor ./executor
COPY dcp_cli ./dcp_cli
COPY examples ./examples
RUN pip install '.[torch]' \
    && useradd --system --uid 10001 dcp
USER dcp
CMD ["torchrun", "--nproc_per_node", "4", "examples/train_1d.py", "--url", "http://127.0.0.1:8000", "--steps", "4"]
