#!/usr/bin/env bash
# Build weightcast's container image on this machine from package registries only, then smoke-test it.
#   IMAGE          the tag to build (default localhost/weightcast:0.1.0)
#   TORCH_VARIANT  cpu (default: torch's CPU build, every wheel collected here) or cuda (torch from PyPI)
# The base is Debian bookworm with python3, made by mmdebstrap from Debian's packages (no registry
# image is pulled); the build runs with chroot isolation, which needs no OCI runtime.
set -euo pipefail
IMAGE=${IMAGE:-localhost/weightcast:0.1.0}
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
BASE=localhost/weightcast-base:bookworm
cd "$(dirname "$0")/../.."

need() {   # the Debian package that provides a command, installed when missing
    command -v "$1" >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2"
}
need mmdebstrap mmdebstrap
need podman podman
need runc runc

mkdir -p build/image
if ! podman image exists "$BASE"; then
    echo "image: making the base file system from Debian packages (mmdebstrap)" >&2
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm build/image/base.tar
    podman import --quiet build/image/base.tar "$BASE" >/dev/null
    rm -f build/image/base.tar
fi

echo "image: collecting wheels ($TORCH_VARIANT)" >&2
rm -rf build/image/wheels
if [ "$TORCH_VARIANT" = cpu ]; then
    .venv/bin/pip wheel --quiet -w build/image/wheels -c constraints.txt torch==2.13.0 .
else
    .venv/bin/pip wheel --quiet -w build/image/wheels --no-deps .
fi

echo "image: building $IMAGE" >&2
podman build --quiet --isolation chroot --build-arg BASE="$BASE" --build-arg TORCH_VARIANT="$TORCH_VARIANT" \
    -t "$IMAGE" . >/dev/null
rm -rf build/image/wheels
infra/image/smoke.sh "$IMAGE"
