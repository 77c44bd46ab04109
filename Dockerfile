# syntax=docker/dockerfile:1
# stargrpc: multi-stage build; the runtime image has the virtualenv and bubblewrap (the
# sandbox of the python and shell tools) and runs as non-root. bubblewrap needs the
# container started with the seccomp profile from deploy/seccomp_profile.py (see
# docs/operate/docker.md); without it the sandboxed tools are refused (SANDBOX_UNAVAILABLE), never run
# with weaker isolation. `docker run … stargrpc doctor` says which applies.

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stargrpc ./stargrpc
COPY tools ./tools
# The server with its MCP features (--mcp-port, mcp_servers): the mcp extra.
RUN /opt/venv/bin/pip install '.[mcp]'

FROM python:3.11-slim AS runtime
# bubblewrap: unprivileged (not setuid), it builds the sandbox in user namespaces.
# util-linux (prlimit, setpriv) is part of the base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*
# The state folder (keys file, audit database) is the server user's alone: 0700.
RUN groupadd --system --gid 10001 stargrpc \
 && useradd --system --uid 10001 --gid stargrpc --home-dir /var/lib/stargrpc --create-home \
      --shell /usr/sbin/nologin stargrpc \
 && chmod 0700 /var/lib/stargrpc
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
