# syntax=docker/dockerfile:1
# stargrpc: multi-stage build; the runtime image has only the virtualenv and runs as non-root.

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stargrpc ./stargrpc
COPY tools ./tools
RUN /opt/venv/bin/pip install .

FROM python:3.11-slim AS runtime
RUN groupadd --system --gid 10001 stargrpc \
 && useradd --system --uid 10001 --gid stargrpc --home-dir /var/lib/stargrpc --create-home \
      --shell /usr/sbin/nologin stargrpc
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    STARGRPC_HOST=0.0.0.0 \
    STARGRPC_PORT=50051 \
    STARGRPC_STATE_DIR=/var/lib/stargrpc \
    STARGRPC_LOG_FORMAT=json
USER 10001:10001
WORKDIR /var/lib/stargrpc
VOLUME ["/var/lib/stargrpc"]
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
  CMD ["stargrpc", "health", "--target", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["stargrpc"]
CMD ["serve"]
