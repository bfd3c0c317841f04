"""What a download job needs from the daemon that runs it: the daemon implements ``JobHost``, the job
(``peerd/job.py``) knows only this, so the job never imports the daemon (as Kraken's dispatcher
declares the ``Events`` it sends instead of importing the scheduler)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from peerd.chunk_fetch import ChunkFetcher
    from peerd.config import PeerdConfig
    from peerd.membership import Membership
    from peerd.metrics import PeerdMetrics
    from peerd.ratelimit import TokenBucket
    from peerd.store import ChunkStore


@runtime_checkable
class JobHost(Protocol):
    config: "PeerdConfig"                  # this host's id, policy, failure detection, peer limits
    metrics: "PeerdMetrics"                # counters the job moves (chunks, bytes, failures, progress)
    membership: "Membership"               # who is alive, at which address
    store: "ChunkStore"                    # other versions' chunks, for local copies
    chunks: "ChunkFetcher"                 # GETs a chunk from a peer into a buffer
    s3_session: Any                        # the aiobotocore session origin reads share
    origin_bucket: "TokenBucket"           # this host's origin read rate
    download_bucket: "TokenBucket"         # this host's download rate (origin reads skip its queue)

    def note_quarantine(self, peer_id: str, why: str) -> None:
        """A peer served bytes that do not match the manifest: stop asking it, tell the others."""

    def announce_soon(self) -> None:
        """Push this host's bitmap to its peers at the next gossip round."""

    def have_news(self) -> None:
        """A chunk was verified: wake the HAVE links."""
