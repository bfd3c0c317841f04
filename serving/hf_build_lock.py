"""One lock around building a transformers model in this process. ``from_pretrained`` and ``from_config``
set torch's process-wide default dtype while they build: two builds in two threads (two model servers
in one process, as the dev stack runs them, or a publish recording golden prompts beside them) would
each build with the other's dtype."""
import threading

BUILD = threading.Lock()
