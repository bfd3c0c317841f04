"""peerd: the per-host data plane. Knows nothing of Temporal."""
