# syntax=docker/dockerfile:1
# Flotilla's images, one target per component (docs/architecture.md, docs/install.md "Images"):
#   docker build --target engine   -t ghcr.io/flotilla-dev/flotilla-engine:0.1.0 .
#       `flotilla engine serve` and `flotilla model fetch`: flotilla + flotilla-engine, CUDA torch and triton
#   docker build --target operator -t ghcr.io/flotilla-dev/flotilla-operator:0.1.0 .
#       `flotilla operator run`: flotilla + flotilla-operator only, no torch, no CUDA
#   docker build --target gateway  -t ghcr.io/flotilla-dev/flotilla-gateway:0.1.0 .
#       `flotilla gateway run`: flotilla + flotilla-gateway only (tokenizers, no torch)
# The repositories and the uid are flotilla.contract's IMAGE_* names; tests/test_images.py parses this file
# and checks them, the targets, what each installs and that its command parses with the real CLI.
# Both run as uid/gid 65532 (the pods' runAsUser, runAsGroup and fsGroup) on a read-only root filesystem:
# bytecode is compiled here, at build time, and every cache and home directory points into /tmp (the pods
# mount an emptyDir there). Not built in this repository's CI (its machines have no Docker engine).

# -- wheels: the four product distributions, built once; their dependencies come from the index at install time --
FROM python:3.11-slim-bookworm AS wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src ./src
COPY engine ./engine
COPY operator ./operator
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ./engine ./operator ./gateway

# -- engine: the engine distribution with its pinned torch and triton (CUDA wheels from PyPI) --------------
# Not the slim base: Triton compiles its CUDA driver stub and each kernel's launcher with the system C
# compiler at run time (triton.runtime.build), and this image has gcc, libc headers and Python's headers
# without an apt-get of versions that Debian's mirrors stop serving.
FROM python:3.11-bookworm AS engine
RUN groupadd --gid 65532 flotilla \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin flotilla
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    python -m venv /opt/flotilla \
    && /opt/flotilla/bin/pip install --no-cache-dir --disable-pip-version-check --compile \
        /wheels/flotilla-*.whl /wheels/flotilla_engine-*.whl \
    && python -m compileall -q -j 0 /usr/local/lib/python3.11
ENV PATH=/opt/flotilla/bin:$PATH \
    VIRTUAL_ENV=/opt/flotilla \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_CONFIG_HOME=/tmp/.config \
    HF_HOME=/tmp/.cache/huggingface \
    TORCH_HOME=/tmp/.cache/torch \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    TRITON_HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/.triton/cache \
    CUDA_CACHE_PATH=/tmp/.nv/ComputeCache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["flotilla"]
# Serves the model folder mounted at /mnt/models (the operator's mount root) on every address; the
# operator always sets the pod's command itself (flotilla.contract.engine_serve_argv).
CMD ["engine", "serve", "--model", "/mnt/models", "--host", "0.0.0.0"]

# -- operator: flotilla + flotilla-operator only (kopf, kubernetes, pydantic): no torch, no CUDA ----------
FROM python:3.11-slim-bookworm AS operator
RUN groupadd --gid 65532 flotilla \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin flotilla
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    python -m venv /opt/flotilla \
    && /opt/flotilla/bin/pip install --no-cache-dir --disable-pip-version-check --compile \
        /wheels/flotilla-*.whl /wheels/flotilla_operator-*.whl \
    && python -m compileall -q -j 0 /usr/local/lib/python3.11
ENV PATH=/opt/flotilla/bin:$PATH \
    VIRTUAL_ENV=/opt/flotilla \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_CONFIG_HOME=/tmp/.config
WORKDIR /tmp
USER 65532:65532
ENTRYPOINT ["flotilla"]
CMD ["operator", "run"]

# -- gateway: flotilla + flotilla-gateway only (starlette, httpx, tokenizers): no torch, no CUDA ------------
FROM python:3.11-slim-bookworm AS gateway
RUN groupadd --gid 65532 flotilla \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin flotilla
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    python -m venv /opt/flotilla \
    && /opt/flotilla/bin/pip install --no-cache-dir --disable-pip-version-check --compile \
        /wheels/flotilla-*.whl /wheels/flotilla_gateway-*.whl \
    && python -m compileall -q -j 0 /usr/local/lib/python3.11
ENV PATH=/opt/flotilla/bin:$PATH \
    VIRTUAL_ENV=/opt/flotilla \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_CONFIG_HOME=/tmp/.config
WORKDIR /tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["flotilla"]
CMD ["gateway", "run"]
