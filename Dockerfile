# Bundle training image: the PyTorch CUDA runtime image plus this source tree at /app.
#   docker build -t bundle:latest .
#   docker build --build-arg PYTORCH_IMAGE=pytorch/pytorch:<tag> -t bundle:latest .
# torch 2.10.0 is requirements.txt's floor (earlier torch.load(weights_only=True) had published
# bypasses); a base image below it fails the build at the pip step below.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# The base image already holds torch/torchvision inside the ranges of requirements.txt; pinning
# them to the installed versions makes pip keep them instead of pulling a second multi-GB build
# (and fails the build if the base image falls outside the ranges).
COPY requirements.txt /app/requirements.txt
COPY docker/constraints.txt /app/docker/constraints.txt
RUN python -c "import torch, torchvision; print(f'torch=={torch.__version__}'); print(f'torchvision=={torchvision.__version__}')" \
        > /tmp/base-constraints.txt \
    && pip install --no-cache-dir -c /tmp/base-constraints.txt -c /app/docker/constraints.txt \
        -r /app/requirements.txt \
    && rm /tmp/base-constraints.txt

# Fixed uid so bind-mounted data and output directories can be granted to it on every node.
RUN groupadd --gid 10001 bundle \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /bin/bash bundle

COPY . /app
RUN chmod 0755 /app/docker/entrypoint.sh /app/scripts/run-bundle-hp.sh

USER 10001:10001
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["--help"]
