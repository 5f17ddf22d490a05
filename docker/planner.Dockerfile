# The planner service (no torch): FastAPI + uvicorn + OR-Tools, plans in a SQLite file on a volume.
#   docker build -f docker/planner.Dockerfile -t dcp-planner .
#   docker run -p 127.0.0.1:8000:8000 -v dcp-data:/var/lib/dcp dcp-planner
# The same command as the README's `make run`: `dcp serve` (settings from DCP_* variables).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DCP_HOST=0.0.0.0 \
    DCP_PORT=8000 \
    DCP_DB_PATH=/var/lib/dcp/plans.sqlite \
    DCP_DATA_DIR=/var/lib/dcp/data \
    MPLCONFIGDIR=/tmp/matplotlib

WORKDIR /app
COPY pyproject.toml README.md ./
COPY costmodel ./costmodel
COPY planner ./planner
COPY api ./api
COPY executor ./executor
COPY ingest ./ingest
COPY report ./report
COPY dcp_cli ./dcp_cli
# Base dependencies only: the service never imports torch (nor the dataset readers of the data extra).
RUN pip install . \
    && useradd --system --uid 10001 dcp \
    && mkdir -p /var/lib/dcp/data \
    && chown -R 10001 /var/lib/dcp

USER 10001
VOLUME ["/var/lib/dcp"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
# Set DCP_AUTH_TOKEN to protect writes; DCP_NUM_WORKERS for the solver processes.
CMD ["dcp", "serve"]
