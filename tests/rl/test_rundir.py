"""The run directory: its metrics lines survive a kill mid-line and are cut back on resume."""

from __future__ import annotations

import json


def test_metrics_lines_are_json(tmp_path):
    from fp4rl.rl.rundir import RunDir

    run = RunDir(tmp_path)
    for step in range(1, 5):
        run.append_metrics({"step": step})
    with open(run.metrics_file, "a") as f:
        f.write('{"step": 5, "rew')  # a line cut by a kill
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3, 4]
    run.truncate_metrics(3)
    assert [json.loads(x)["step"] for x in run.metrics_file.read_text().splitlines()] == [1, 2, 3]
    assert run.holds_run()
    run.clear_metrics()
    assert not run.holds_run()
