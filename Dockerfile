# IMPALA trainer image.
#
#   docker build -t impala .
#   docker run --gpus all --shm-size=8g -v "$PWD/runs:/app/runs" impala --env PongNoFrameskip-v4
#
# Build arguments:
#   BASE_IMAGE      any Debian-like image with Python 3.11 to 3.14 and the venv module
#                   (default: the official slim image).
#   PIP_EXTRA_ARGS  extra flags for the dependency install, e.g.
#                   "--find-links /wheels --cert /ca.crt" to take torch from a local wheel folder
#                   behind a TLS-intercepting proxy. Empty by default: torch then comes from PyPI,
#                   whose Linux wheels carry CUDA.
#   WITH_RAY        1 to include Ray (requirements-ray.txt) for remote actors (--ray); the same image
#                   then serves as the learner, the Ray head and every Ray worker (README, "Many machines").
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    MPLCONFIGDIR=/tmp/matplotlib

# A numeric, non-root user (uid/gid 1000) that owns the runs directory. Dependencies go into a
# virtual environment so that `python` exists whether the base ships `python` or only `python3`
# (and so that pip never touches a distribution-managed interpreter).
RUN groupadd --gid 1000 impala \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/sh impala \
    && python3 -m venv /opt/venv \
    && mkdir -p /app/runs \
    && chown 1000:1000 /app/runs

WORKDIR /app

# Dependencies in their own layer, before the code: a code-only change reuses this layer.
COPY requirements.txt requirements-ray.txt ./
ARG PIP_EXTRA_ARGS=""
ARG WITH_RAY=0
# PIP_EXTRA_ARGS is left unquoted on purpose: it holds several flags.
RUN pip install --no-cache-dir ${PIP_EXTRA_ARGS} -r requirements.txt \
    && if [ "${WITH_RAY}" = 1 ]; then pip install --no-cache-dir ${PIP_EXTRA_ARGS} -r requirements-ray.txt; fi

COPY . .

USER 1000:1000

# Runs and checkpoints (model.tar, TensorBoard event files) go here: mount a host directory.
VOLUME ["/app/runs"]
# TensorBoard (see the README's Docker section).
EXPOSE 6006

ENTRYPOINT ["python", "run.py"]
CMD ["--env", "PongNoFrameskip-v4", "--savedir", "/app/runs"]
