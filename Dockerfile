# Flotilla's images, one target per component; both run as uid/gid 65532, the user the pods'
# securityContext sets (runAsUser 65532, runAsNonRoot, read-only root filesystem).
#   docker build --target engine   -t flotilla-engine .    # `flotilla engine serve`, `flotilla model fetch`
#   docker build --target operator -t flotilla-operator .  # `flotilla operator run`: no torch, no CUDA
# Not built in this repository's CI (its machines have no Docker engine).
FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/flotilla
COPY pyproject.toml README.md ./
COPY src ./src
RUN groupadd --gid 65532 flotilla && useradd --uid 65532 --gid 65532 --no-create-home flotilla

FROM base AS engine
COPY engine ./engine
RUN pip install --no-cache-dir . ./engine
USER 65532:65532
ENTRYPOINT ["flotilla"]
CMD ["engine", "serve", "--help"]

FROM base AS operator
COPY operator ./operator
RUN pip install --no-cache-dir . ./operator
USER 65532:65532
ENTRYPOINT ["flotilla"]
CMD ["operator", "run"]
