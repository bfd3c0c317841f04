# weightcast's one image: the host processes (peerd, the host worker, the model server), the control
# worker, the router and the CLI; the Kubernetes manifests pick the process by its command.
#
#   make image                                   # CPU torch, from the wheels `make image` collects
#   make image TORCH_VARIANT=cuda                # torch from PyPI's default build (CUDA) instead
#   docker build --build-arg BASE=python:3.11-slim-bookworm .    # elsewhere, from a registry's Python
#
# BASE needs python3 (3.11+) with venv. `make image` makes one from Debian packages with mmdebstrap,
# since this project installs from package registries only.
ARG BASE=localhost/weightcast-base:bookworm
FROM ${BASE}

# cpu: every wheel comes from build/image/wheels (torch's CPU build among them), nothing is fetched.
# cuda: torch (and its CUDA libraries) come from PyPI's default index at build time.
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

COPY build/image/wheels /wheels
RUN python3 -m venv /opt/weightcast \
 && if [ "$TORCH_VARIANT" = "cuda" ]; then \
        /opt/weightcast/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
     && /opt/weightcast/bin/pip install --no-cache-dir --find-links /wheels weightcast; \
    else \
        /opt/weightcast/bin/pip install --no-cache-dir --no-index --find-links /wheels weightcast "torch==${TORCH_VERSION}"; \
    fi \
 && rm -rf /wheels

ENV PATH=/opt/weightcast/bin:$PATH \
    PYTHONUNBUFFERED=1
# the GPU node's store (a hostPath the node owns as root) and the signing key are mounted by
# infra/k8s/host-daemonset.yaml; the processes run as the image's root user to write the store
WORKDIR /var/lib/weightcast
CMD ["weightcast", "--help"]
