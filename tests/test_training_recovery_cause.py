"""Which failure the training workflow records as the cause, on the real dev server with the host
activities stubbed at their boundary (no ranks): a rank killed by a signal breaks its peers'
collectives at once, and their errors may be reported first; the killed rank is still the cause."""
import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from workers import control_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput, TrainRankInput, TrainRankResult
from workflows.types import CONTROL_QUEUE, host_queue

STEPS = 40


def host_activities(host: str) -> list:
    @activity.defn(name="rendezvous")
    async def rendezvous(run: str) -> str:
        return "tcp://127.0.0.1:1"

    @activity.defn(name="train_rank")
    async def train_rank(inp: TrainRankInput) -> TrainRankResult:
        if inp.attempt == 0 and inp.rank == 0:            # the survivor: its collective broke
            raise ApplicationError(f"rank 0 on {host} exited with 1: Connection reset by peer", {"signal": None},
                                   type="RankFailed", non_retryable=True)
        if inp.attempt == 0:                              # killed, and reported a moment later
            await asyncio.sleep(0.5)
            raise ApplicationError(f"rank 1 on {host} killed by SIGKILL", {"signal": "SIGKILL"},
                                   type="RankFailed", non_retryable=True)
        return TrainRankResult(inp.rank, STEPS, 15, 1.0, [])
    return [rendezvous, train_rank]


async def test_a_rank_killed_by_a_signal_is_the_cause_even_when_its_peers_error_reaches_the_workflow_first(
        keys, temporal):
    client: Client = await temporal.client()
    workers = [Worker(client, task_queue=host_queue(h), activities=host_activities(h)) for h in ("t0", "t1")]
    run = uuid.uuid4().hex[:6]
    inp = TrainingInput(run=run, config={"world_size": 2, "steps": STEPS, "global_batch": 8, "seq_len": 16},
                        hosts=["t0", "t1"], checkpoint_dir="/nonexistent", heartbeat_timeout_s=2.0)
    async with workers[0], workers[1], control_worker.build(client, [keys["pub_path"]]):
        result = await client.execute_workflow(TrainingWorkflow.run, inp, id=f"train-{run}", task_queue=CONTROL_QUEUE)
    [recovery] = result.recoveries
    assert (recovery.rank, recovery.host, recovery.action) == (1, "t1", "restart on t1")
    assert "killed by SIGKILL" in recovery.reason and result.steps == STEPS
