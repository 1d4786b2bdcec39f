# syntax=docker/dockerfile:1
# The coserve control-plane image: the operator, the router and the endpoint picker (`coserve ...`, extras
# operator, router and epp, versions from constraints.txt). The engines run images/vllm/Dockerfile instead.
#
#   docker build -t ghcr.io/coserve/coserve:0.1.0 .
#
# NOTE: both stages use the same base image because the venv's python is a symlink into it.

FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/venv/bin/pip install -c constraints.txt "$(echo /wheels/coserve-*.whl)[operator,router,epp]"


FROM python:3.11-slim

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="coserve" \
      org.opencontainers.image.description="coserve control plane: the CoServePool operator, the router and the endpoint picker" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/coserve/coserve" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 65532 coserve \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin coserve
COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Numeric, so runAsNonRoot can verify it without looking the name up.
USER 65532:65532
ENTRYPOINT ["coserve"]
CMD ["--help"]
