# jitserve, CPU image. Versions come only from pyproject.toml (pip install .).
# Build: docker build -t jitserve .
# Warm start: put MODEL.onnx into aot/ and build with
#   --build-arg AOT_MODEL=aot/MODEL.onnx --build-arg AOT_SHAPES="--shape x=1,3,48,192 --shape x=8,3,48,192"
# Kernels are keyed by the host CPU LLVM detects: build on the CPU family you deploy on.
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# g++: TVM links every compiled kernel into a shared library at run time.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY compiler ./compiler
COPY server ./server
RUN pip install .

RUN useradd --create-home --uid 10001 jitserve && mkdir -p /data && chown jitserve:jitserve /data
USER jitserve
ENV JITSERVE_DATA_DIR=/data JITSERVE_HOST=0.0.0.0 JITSERVE_PORT=8000 JITSERVE_GRPC_PORT=8001

# Optional ahead-of-time compile: the kernels land in /data and a fresh volume starts with them.
COPY --chown=jitserve:jitserve aot/ ./aot/
ARG AOT_MODEL=""
ARG AOT_SHAPES=""
RUN if [ -n "$AOT_MODEL" ]; then python -m compiler compile "$AOT_MODEL" $AOT_SHAPES --store /data/kernels; fi

VOLUME /data
# 8000: HTTP (REST, /v2, /metrics, /healthz); 8001: gRPC, the Open Inference Protocol's
# inference.GRPCInferenceService (JITSERVE_GRPC_PORT; 0 turns it off).
EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
# A non-loopback bind needs JITSERVE_ADMIN_TOKEN: the server refuses to start without it.
CMD ["python", "-m", "server"]
