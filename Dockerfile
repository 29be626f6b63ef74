# syntax=docker/dockerfile:1
# pdserve's images, one target per image variant of the Helm chart (helm/pdserve):
#   docker build --target engine -t pdserve:0.1.0 .       prefill and decode workers on CPUs,
#                                                          and `pdserve prepare-model`
#   docker build --target cuda -t pdserve:0.1.0-cuda .    the workers on NVIDIA GPUs
#   docker build --target slim -t pdserve:0.1.0-slim .    the gateway and the kvstore: no torch
# Each install step is a Makefile target (install-engine, install-slim), as on a laptop.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS source
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml Makefile README.md LICENSE ./
COPY constraints/ constraints/
COPY docker/ docker/
COPY services/ services/
COPY kernels/ kernels/

FROM source AS install-engine
RUN make install-engine VENV=/opt/venv

FROM source AS install-cuda
RUN make install-engine VENV=/opt/venv TORCH=cuda

FROM source AS install-slim
RUN make install-slim VENV=/opt/venv

# What every image runs as: the chart's podSecurityContext (uid 10001) and its cache volume
# at /var/cache/pdserve ($PDSERVE_HOME: compile cache, C kernels; HOME for the rest), so
# the root filesystem can stay read-only.
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --home-dir /var/cache/pdserve --no-create-home pdserve \
    && install -d -o 10001 -g 10001 /var/cache/pdserve
ENV PATH=/opt/venv/bin:$PATH \
    PDSERVE_HOME=/var/cache/pdserve \
    HOME=/var/cache/pdserve \
    XDG_CACHE_HOME=/var/cache/pdserve/xdg \
    TRITON_CACHE_DIR=/var/cache/pdserve/triton \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /var/cache/pdserve
CMD ["pdserve", "--help"]

FROM runtime AS slim
COPY --from=install-slim /opt/venv /opt/venv
USER 10001

# The engine compiles on its machine: inductor's C++ and the C kernels need a compiler.
FROM runtime AS engine-runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM engine-runtime AS cuda
COPY --from=install-cuda /opt/venv /opt/venv
USER 10001

FROM engine-runtime AS engine
COPY --from=install-engine /opt/venv /opt/venv
USER 10001
