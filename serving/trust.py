"""Which versions in peerd's store a model server loads: those whose manifest is signed by a key it
trusts, and pinned ones (unsigned training checkpoints, vouched for by the cluster token when they
were handed to peerd) only when it was started to allow them. The engines then prove every byte
against that manifest (serving/verified_read.py); this decides whether the manifest is one to serve."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from peerd import manifest as mf
from serving.loader import LoadError


@dataclass(frozen=True)
class ManifestTrust:
    # None: signatures are not checked (in-process tests and benchmarks only; `serving.server` requires
    # --trusted-key). Pinned versions are refused either way unless ``allow_pinned``.
    keys: tuple[Ed25519PublicKey, ...] | None = None
    allow_pinned: bool = False

    def check(self, model_dir: Path) -> None:
        """Raise LoadError("untrusted") unless the manifest stored beside ``model_dir``
        (``<store>/versions/<vid>/model``) is one this server may serve."""
        vid, where = model_dir.parent.name, model_dir.parent / "manifest.json"
        try:
            raw = where.read_bytes()
            doc = json.loads(raw)
        except (OSError, ValueError) as e:
            raise LoadError("unverified", f"no readable manifest at {where}: {e}") from None
        if isinstance(doc, dict) and doc.get("pinned") is True:
            if not self.allow_pinned:
                raise LoadError("untrusted", f"version {vid[:12]}… is pinned (an unsigned training checkpoint, not "
                                             "a signed release); this model server loads signed versions only "
                                             "(start it with --allow-pinned to load pinned ones)")
            return
        if self.keys is None:
            return
        try:
            m = mf.load_signed(raw, list(self.keys))
        except mf.ManifestError as e:
            raise LoadError("untrusted", f"version {vid[:12]}…: {e}") from None
        if m.digest != vid:
            raise LoadError("untrusted", f"the signed manifest at {where} is version {m.digest[:12]}…, not the "
                                         f"{vid[:12]}… its directory names")
