"""The repository speaks of the product as it is: no words about how it was built (work periods,
issue numbers, briefs), which mean nothing to a reader who has only the repository. History is git's."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the words are assembled, so this file does not contain the phrases it looks for
SESSION, ISSUE, BRIEF = "sess" + "ion", "iss" + "ue", "the " + "brief"
PROCESS_WORDS = re.compile(
    rf"\b{SESSION}s? \d+"                                   # a numbered work period, or a range of them
    rf"|\b(?:this|that|each|every|earlier|previous|later|next|last) {SESSION}\b"
    rf"|\b{ISSUE}s? #?\d+"                                  # a tracker number
    rf"|\b{BRIEF}\b|(?<![a-z])brief_|\bthis task\b|\blent to this\b|\bthe {ISSUE}'s\b",   # brief_: in a name
    re.IGNORECASE)
SKIP = {"tests/test_words.py"}
SKIP_DIRS = ("tests/histories/",)           # recorded Temporal histories: data, replayed as they are


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = []
    for name in out.decode().split("\0"):
        if not name or name in SKIP or name.startswith(SKIP_DIRS):
            continue
        path = REPO / name
        if path.is_file() and b"\0" not in path.read_bytes()[:4096]:
            files.append(path)
    return files


def test_no_words_about_the_work_process_anywhere():
    found = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = PROCESS_WORDS.search(line)
            if m:
                found.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)!r}")
    assert not found, "say what is true of the product, not when or why it was built:\n" + "\n".join(found[:60])


def test_the_check_finds_what_it_is_for():
    for text in (f"as measured in {SESSION} 12", f"({SESSION}s 14-15)", f"{ISSUE.title()} 9's probes",
                 f"as in {BRIEF}", f"the previous {SESSION} kept it", f"see {ISSUE} #13",
                 "def test_" + "brief_baselines():", "def test_prints_the_" + "brief_comparison():"):
        assert PROCESS_WORDS.search(text), text
    for text in ("aiohttp.ClientSession()", "a session-scoped fixture", "start_new_session=True",
                 "to issue a request", "the HTTP session's cookies", "cleanup_ctx.append(session)",
                 "two seeders that briefly disagree", "You answer briefly."):
        assert not PROCESS_WORDS.search(text), text
