# The project image: the `coordinator` CLI (proxy node, mock engine, demo, bench).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY proxy_node ./proxy_node
COPY local_fleet ./local_fleet
COPY bench ./bench
COPY coordinator_cli ./coordinator_cli
RUN pip install --no-cache-dir . && useradd --system --uid 10001 coordinator
USER coordinator
ENTRYPOINT ["coordinator"]
CMD ["--help"]
