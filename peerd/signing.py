"""Ed25519 keys: generate, load, sign, verify. The manifest module decides *what* is signed."""
from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class KeyError_(ValueError):
    """A key file is missing or is not an Ed25519 key."""


def generate_keypair(private_path: Path, public_path: Path) -> None:
    """Write a new PEM private key (mode 0600) and its public key; never overwrite an existing key."""
    for p in (private_path, public_path):
        if p.exists():
            raise KeyError_(f"{p} already exists; refusing to overwrite a key (delete it first if you mean to)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise KeyError_(f"private key {path} not found; create one with `weightcast keys generate`") from None
    except ValueError as e:
        raise KeyError_(f"{path} is not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"{path} is not an Ed25519 key")
    return key


def load_public_key(path_or_pem: Path | bytes) -> Ed25519PublicKey:
    data = path_or_pem if isinstance(path_or_pem, bytes) else None
    if data is None:
        try:
            data = Path(path_or_pem).read_bytes()
        except FileNotFoundError:
            raise KeyError_(f"public key {path_or_pem} not found") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as e:
        raise KeyError_(f"not a PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyError_("public key is not an Ed25519 key")
    return key


def public_key_id(key: Ed25519PublicKey) -> str:
    """A short stable name for a key, recorded in signatures so hosts can pick the right one."""
    import hashlib
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return base64.b64encode(key.sign(message)).decode()


def verify(keys: list[Ed25519PublicKey], message: bytes, signature_b64: str, key_id: str) -> bool:
    try:
        sig = base64.b64decode(signature_b64, validate=True)
    except (ValueError, TypeError):
        return False
    for k in keys:
        if public_key_id(k) != key_id:
            continue
        try:
            k.verify(sig, message)
            return True
        except InvalidSignature:
            return False
    return False
