#!/usr/bin/env bash
# Run the image's entry points: the CLI, peerd's and the model server's help, and a real peerd that
# answers its health check, all inside one container (no network: peerd on the container's loopback).
# Prints one JSON line; exits non-zero if any check fails.
#
# runc with lowered rlimits: where root lacks CAP_SYS_RESOURCE (this project's CI machines), the OCI
# runtime cannot apply podman's default rlimits, and crun refuses hybrid cgroup hierarchies. On an
# ordinary host `podman run IMAGE ...` needs neither (PODMAN_RUN overrides the command).
set -euo pipefail
IMAGE=${1:?usage: smoke.sh IMAGE}
PODMAN_RUN=${PODMAN_RUN:-podman --runtime runc run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024}

$PODMAN_RUN "$IMAGE" sh -ec '
weightcast --help > /dev/null
python -m peerd --help > /dev/null
python -m serving.server --help > /dev/null
cd /tmp
python -c "from pathlib import Path; from peerd.signing import generate_keypair as g; g(Path(\"k.pem\"), Path(\"k.pub\"))"
WEIGHTCAST_TOKEN=smoke python -m peerd --id smoke --store /tmp/store --port 7700 --trusted-key k.pub \
    --ready-file ready.json > peerd.log 2>&1 &
for _ in $(seq 100); do [ -s ready.json ] && break; sleep 0.2; done
python - <<PY
import json, sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:7700/healthz", timeout=5) as r:
    health = json.load(r)
print(json.dumps({"image_ok": bool(health.get("ok")), "python": sys.version.split()[0],
                  "cli": "weightcast --help", "peerd_healthz": health}))
sys.exit(0 if health.get("ok") else 1)
PY
'
