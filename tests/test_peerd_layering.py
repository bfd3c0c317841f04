"""peerd's layering: a download job knows its daemon only through ``JobHost``, and uses nothing else
of it; the daemon provides every member ``JobHost`` declares."""
import ast
import re
from pathlib import Path

from peerd.job_host import JobHost

PEERD = Path(__file__).resolve().parent.parent / "peerd"


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names})


def declared() -> set[str]:
    methods = {n for n, v in vars(JobHost).items() if callable(v) and not n.startswith("_")}
    return set(JobHost.__annotations__) | methods


def test_the_job_does_not_import_the_daemon_and_uses_only_what_job_host_declares():
    assert "peerd.daemon" not in imports(PEERD / "job.py")
    used = set(re.findall(r"self\.host\.(\w+)", (PEERD / "job.py").read_text()))
    assert used and used <= declared(), used - declared()


def test_the_daemon_provides_every_member_of_job_host():
    daemon = (PEERD / "daemon.py").read_text()
    missing = [m for m in declared() if f"self.{m} =" not in daemon and f"def {m}(" not in daemon]
    assert not missing, missing
