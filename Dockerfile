# The image every Flotilla pod runs: the engine (`flotilla engine serve`) and the operator
# (`flotilla operator run`) share it, so the command the operator builds works in the image and in the
# local cluster alike. Not built in this repository's CI (its machines have no Docker engine).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/flotilla

COPY pyproject.toml README.md ./
COPY flotilla ./flotilla
COPY engine ./engine
COPY operator ./operator
COPY crds ./crds
RUN pip install --no-cache-dir . && useradd --uid 10001 --create-home flotilla

# Non-root, matching the pods' securityContext (runAsNonRoot, read-only root filesystem).
USER 10001
ENTRYPOINT ["flotilla"]
CMD ["--help"]
