"""Golden histories replay against today's workflow code: a change that is not replay-safe fails CI.
Re-record with WEIGHTCAST_RECORD_HISTORIES=1 pytest tests/test_rollout.py tests/test_full_size_rollout.py
tests/test_rollout_controls.py tests/test_training_workflow.py (manifest by reference; pause/resume and
abort mid-distribution; a training run's recoveries) after an intended, patched change (see
docs/control-plane.md). train-golden.json (a rank killed and recovered, checkpoint-now, pause and
resume) was recorded by running those steps against the dev server once."""
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.control_worker import WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


@pytest.mark.asyncio
@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_golden_history_replays(path):
    workflow_id = path.stem.removesuffix("-by-ref")                     # file name = workflow id (+ a tag)
    history = WorkflowHistory.from_json(workflow_id, path.read_text())
    result = await Replayer(workflows=WORKFLOWS).replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"


def test_there_are_golden_histories():
    assert HISTORIES, "no golden histories committed under tests/histories/"


def test_replay_cli(capsys):
    from weightcast.cli import main
    assert main(["rollout", "replay", str(HISTORIES[0])]) == 0
    assert '"replayed": true' in capsys.readouterr().out
