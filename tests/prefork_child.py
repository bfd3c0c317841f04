"""A daemon for tests/test_prefork.py: writes what it was started with, then exits, waits or crashes."""
import json
import os
import sys
import time


def main(argv=None) -> int:
    out, action = argv[0], argv[1]
    with open(out + ".part", "w") as f:
        json.dump({"argv": argv, "cwd": os.getcwd(), "env": os.environ.get("PREFORK_TEST"), "pid": os.getpid(),
                   "netns": os.stat("/proc/self/ns/net").st_ino,
                   "cmdline": open("/proc/self/cmdline").read().replace("\0", " ").strip()}, f)
    os.replace(out + ".part", out)
    print(f"started with {argv}", flush=True)
    if action == "exit":
        return int(argv[2])
    if action == "raise":
        raise ValueError("the daemon's own crash")
    while True:                      # "wait": until signalled
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
