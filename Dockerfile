# The project image: the `coordinator` CLI (proxy node, mock engine, demo, bench).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY proxy_node ./proxy_node
RUN pip install --no-cache-dir . && useradd --system --uid 10001 coordinator
USER coordinator
ENTRYPOINT ["coordinator"]
CMD ["--help"]
