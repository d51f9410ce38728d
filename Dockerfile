# detokd as a container: `docker run -v $PWD/my.toml:/etc/detokd/detokd.toml detokd`
# serves the mounted config; any `detokd` command works as the container's arguments.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 \
    DETOKD_ZOO_CACHE=/opt/detokd/zoo
WORKDIR /opt/detokd
COPY pyproject.toml README.md ./
COPY detokd ./detokd
# The packaged tokenizer is built into the image, so a container starts without
# writing anything and works with a read-only root filesystem.
RUN pip install . \
 && detokd tokenizer deepseek \
 && useradd --system --no-create-home detokd
COPY configs/default.toml /etc/detokd/detokd.toml

USER detokd
# Sockets for the default ipc:// addresses live in /tmp; mount a volume there to share
# them with the engine, or use tcp:// addresses in your config.
ENTRYPOINT ["detokd"]
CMD ["serve", "--config", "/etc/detokd/detokd.toml"]
