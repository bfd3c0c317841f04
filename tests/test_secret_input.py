"""Secrets from the environment or a file, never a flag: lib/secret_input.py."""
import argparse

import pytest

from lib.secret_input import ADMIN_TOKEN, CLUSTER_TOKEN, add_secret_file_arg, read_secret


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_secret_file_arg(ap, CLUSTER_TOKEN, "cluster token")
    add_secret_file_arg(ap, ADMIN_TOKEN, "admin token")
    return ap


def test_a_secret_comes_from_its_variable_first_then_its_file(tmp_path, monkeypatch):
    monkeypatch.delenv(CLUSTER_TOKEN, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN, raising=False)
    (tmp_path / "token").write_text("from-the-file\n")
    a = parser().parse_args(["--token-file", str(tmp_path / "token")])
    assert read_secret(a, CLUSTER_TOKEN) == "from-the-file" and read_secret(a, ADMIN_TOKEN) == ""
    monkeypatch.setenv(CLUSTER_TOKEN, "from-the-environment")
    assert read_secret(a, CLUSTER_TOKEN) == "from-the-environment"
    with pytest.raises(SystemExit, match="cannot read the secret file"):
        read_secret(parser().parse_args(["--admin-token-file", str(tmp_path / "missing")]), ADMIN_TOKEN)


def test_no_flag_takes_a_secret_itself(monkeypatch):
    """A value given on the command line is only ever a file's name, read as such."""
    monkeypatch.delenv(CLUSTER_TOKEN, raising=False)
    with pytest.raises(SystemExit, match="cannot read the secret file s3cret"):
        read_secret(parser().parse_args(["--token", "s3cret"]), CLUSTER_TOKEN)     # argparse: --token-file
