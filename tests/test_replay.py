"""Golden histories replay against today's workflow code: a change that is not replay-safe fails CI.
Each file under tests/histories/ is a history a test made (tests/golden.py). Re-record after an
intended, patched change (docs/control-plane.md) with
WEIGHTCAST_RECORD_HISTORIES=1 pytest tests/test_rollout.py tests/test_full_size_rollout.py
tests/test_rollout_controls.py tests/test_rollout_analysis.py tests/test_rollout_shape.py
(train-golden.json, a rank killed and recovered, checkpoint-now, pause and resume, was
recorded by running those steps against the dev server once)."""
import pytest

from tests.golden import HISTORIES as GOLDEN
from weightcast.history_file import read_history
from workers.control_worker import replayer

HISTORIES = sorted([*GOLDEN.glob("*.json"), *GOLDEN.glob("*.json.gz")])


@pytest.mark.asyncio
@pytest.mark.parametrize("path", HISTORIES, ids=[p.name.split(".")[0] for p in HISTORIES])
async def test_golden_history_replays(path):
    history = read_history(path)
    result = await replayer().replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"


def test_there_are_golden_histories():
    assert HISTORIES, "no golden histories committed under tests/histories/"


def test_replay_cli(capsys):
    from weightcast.cli import main
    assert main(["rollout", "replay", str(HISTORIES[0])]) == 0
    assert '"replayed": true' in capsys.readouterr().out
