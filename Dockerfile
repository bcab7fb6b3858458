# One image for every P-LoRA service; docker-compose.yml picks the service with `plora serve X`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PLORA_CACHE_DIR=/cache
WORKDIR /app

RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md Makefile ./
COPY protos ./protos
COPY plora ./plora
COPY services ./services
# Same targets as a laptop: install the project and the default model, compile the protos.
RUN make setup PYTHON=python3 && rm -rf /root/.cache/pip

ENV PATH=/app/.venv/bin:$PATH
# gateway 50051, worker 50061, predictor 50071; metrics 9100-9102
EXPOSE 50051 50061 50071 9100 9101 9102
ENTRYPOINT ["plora"]
CMD ["serve", "gateway", "--host", "0.0.0.0"]
