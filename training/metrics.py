"""A host's training ranks in Prometheus (the host worker's ``/metrics``, ``--metrics-port``): per run
and rank, from the same progress the ``train_rank`` activity heartbeats."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

LABELS = ("run", "rank")


class TrainingMetrics:
    def __init__(self, registry: CollectorRegistry):
        def g(name: str, doc: str) -> Gauge:
            return Gauge(f"weightcast_train_{name}", doc, LABELS, registry=registry)
        self.step = g("step", "the last step this rank finished")
        self.loss = g("loss", "the training loss of that step (the ranks that report one)")
        self.step_seconds = g("step_seconds", "the last step's wall time")
        self.tokens_per_second = g("tokens_per_second", "this rank's tokens over the last step's time")
        self.mfu = g("mfu", "model FLOPs utilisation of this rank against its measured matmul peak")
        self.comm_fraction = g("comm_fraction", "share of the newest profiled step with a collective in flight")
        self.eval_loss = g("eval_loss", "held-out loss of the final weights")

    def observe(self, run: str, rank: int, beat: dict) -> None:
        labels = (run, str(rank))
        for gauge, key in ((self.step, "step"), (self.loss, "loss"), (self.step_seconds, "step_s"),
                           (self.tokens_per_second, "tokens_per_s"), (self.mfu, "mfu"),
                           (self.comm_fraction, "comm_fraction"), (self.eval_loss, "eval_loss")):
            if beat.get(key) is not None:
                gauge.labels(*labels).set(beat[key])
