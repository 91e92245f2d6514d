# idemproxy: `docker build -t idemproxy .` then
#   docker run -p 8787:8787 -v idemproxy-data:/var/lib/idemproxy idemproxy
# Configuration: /etc/idemproxy/config.toml (config/docker.toml; mount your own over it)
# and IDEMPROXY_* variables, e.g. -e IDEMPROXY_STORE_URL=postgresql://user:pw@db/idemproxy
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    IDEMPROXY_CONFIG=/etc/idemproxy/config.toml

# Only what the package build needs; .dockerignore keeps tests, clients and the rest out.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY supervisor ./supervisor
COPY config ./config
# asyncpg, redis and uvloop ship wheels for this base, so no compiler is installed.
RUN pip install --no-cache-dir ".[postgres,redis,fast]" \
    && rm -rf /build

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/idemproxy --create-home \
        --shell /usr/sbin/nologin idemproxy \
    && mkdir -p /etc/idemproxy
COPY config/docker.toml /etc/idemproxy/config.toml

USER 10001:10001
WORKDIR /var/lib/idemproxy
EXPOSE 8787

# Exit 0 when the configuration loads and the store answers with a current schema (serve
# makes it at start); exit 1 otherwise. check itself never writes to the store.
HEALTHCHECK --interval=15s --timeout=10s --start-period=20s --retries=3 \
    CMD ["idemproxy", "check"]

CMD ["idemproxy", "serve", "--host", "0.0.0.0"]
