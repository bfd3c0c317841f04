"""The control worker's own command line (its process runs in tests/test_rollout_shape.py: ready file,
workflows polled with bounded slots, a clean stop on SIGTERM)."""
import pytest

from workers import control_worker


@pytest.mark.parametrize("slots", ["0", "-3"])
def test_workflow_task_slots_below_one_are_refused_before_connecting(capsys, slots):
    with pytest.raises(SystemExit) as e:
        control_worker.main(["--trusted-key", "k.pub", "--temporal", "127.0.0.1:9", "--workflow-task-slots", slots])
    assert e.value.code == 2
    assert f"--workflow-task-slots must be at least 1, got {slots}" in capsys.readouterr().err


def test_the_default_is_a_few_slots_not_the_sdks_hundreds():
    a = control_worker.build_parser().parse_args(["--trusted-key", "k.pub"])
    assert a.workflow_task_slots == control_worker.WORKFLOW_TASK_SLOTS == 4 and a.ready_file is None
