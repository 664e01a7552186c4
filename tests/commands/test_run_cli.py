"""``elasticlab run`` with a resize schedule and the fixed per-worker batch policy (Dynamic SGD)."""
import json
import os

import pytest

from elasticlab.__main__ import main
from elasticlab.elastic import check_exactly_once

DIGITS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py")


def test_run_command_resizes_at_scheduled_steps(tmp_path, capsys):
    rec = tmp_path / "samples.jsonl"
    rc = main(["run", DIGITS, "--workers", "1", "--schedule", "6:2,14:1", "--max-steps", "20",
               "--per-worker-batch", "16", "--record-samples", str(rec),
               "--checkpoint-dir", str(tmp_path / "ck"), "--slots", "2", "--timeout", "300"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("RESULT "), out[-5:]
    res = json.loads(out[-1][len("RESULT "):])
    assert rc == 0 and res["finished"] and res["steps"] == 20
    assert res["resizes"] == [[1, 2, 7], [2, 1, 15]]          # from step STEP+1 on, N workers
    assert res["final_loss"] > 0 and res["samples_per_s"] > 0
    rows = [json.loads(line) for line in rec.read_text().splitlines()]
    size = {r["step"]: r["world_size"] for r in rows}
    assert [size[s] for s in range(1, 21)] == [1] * 6 + [2] * 8 + [1] * 6
    batch = {}
    for r in rows:
        batch[r["step"]] = batch.get(r["step"], 0) + len(r["indices"])
    assert {batch[s] for s in range(7, 15)} == {32} and batch[1] == batch[20] == 16   # M = R x 16
    assert check_exactly_once(rows, 1797)["ok"]
    assert res["exactly_once"] == {"ok": True, "missing": 0, "duplicates": 0}   # (20 steps: an epoch begun)


def test_run_command_checks_the_sample_record_of_a_finished_job(tmp_path, capsys):
    """A finished run's RESULT says whether its record holds every sample of its epochs once; the check
    reads the sample count from the newest checkpoint, and of a job that ran its epochs out a short last
    epoch is a failure (the same record cut short passes as a stopped job's)."""
    from elasticlab.commands.run import record_check

    rec, ck = tmp_path / "samples.jsonl", tmp_path / "ck"
    rc = main(["run", DIGITS, "--workers", "2", "--epochs", "1", "--global-batch", "64",
               "--record-samples", str(rec), "--checkpoint-dir", str(ck), "--slots", "2", "--timeout", "300"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT "):])
    assert rc == 0 and res["finished"]
    assert res["exactly_once"] == {"ok": True, "missing": 0, "duplicates": 0}
    lines = rec.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-2]) + "\n")           # the last step's rows of both ranks gone
    short = record_check(str(cut), str(ck), epochs=1)
    assert not short["ok"] and 0 < short["missing"] <= 64 and short["duplicates"] == 0
    assert record_check(str(cut), str(ck), epochs=None)["ok"]
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\n".join(lines + lines[:1]) + "\n")
    assert record_check(str(twice), str(ck), epochs=1)["duplicates"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "5:x"], "bad schedule entry '5:x'"),
    (["--schedule", "5:9", "--slots", "4"], "9 exceeds the machine's 4"),
    (["--workers", "0"], ">= 1, got 0"),
    (["--schedule", "5:99", "--slots", "4"], "schedule entry 5:99"),    # not reported as warm=99
    (["--schedule", "5:2,5:3"], "schedule step 5 is given twice"),
    (["--global-batch", "0"], "global_batch must be a positive integer, got 0"),
    (["--max-steps", "-5"], "max_steps must be a positive integer, got -5"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),  # ran, "timed out"
    (["--per-worker-batch", "0"], "per_worker_batch must be a positive integer, got 0"),    # was ignored
])
def test_run_command_rejects_bad_arguments(argv, message, capsys):
    assert main(["run", DIGITS, *argv]) == 2
    assert message in capsys.readouterr().err


def test_run_command_takes_one_batch_flag(capsys):
    """Both were accepted and --global-batch silently ignored."""
    with pytest.raises(SystemExit) as e:
        main(["run", DIGITS, "--global-batch", "8", "--per-worker-batch", "4"])
    assert e.value.code == 2 and "not allowed with argument --global-batch" in capsys.readouterr().err


def test_run_command_refuses_an_existing_sample_record(tmp_path, capsys):
    rec = tmp_path / "old.jsonl"
    rec.write_text('{"step": 1}\n')
    assert main(["run", DIGITS, "--record-samples", str(rec)]) == 2
    assert "old.jsonl" in capsys.readouterr().err and rec.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("entry", ["nosuch_pkg.module:make_task", "elasticlab.no_such_module", ".rel:fn"])
def test_run_command_names_a_module_it_cannot_import_before_starting_workers(entry, capsys):
    assert main(["run", entry, "--max-steps", "2"]) == 2
    cap = capsys.readouterr()
    mod = entry.partition(":")[0]
    assert f"entrypoint module {mod!r} cannot be imported" in cap.err and "Traceback" not in cap.err
    assert "RESULT" not in cap.out                         # no job started


def test_run_command_reports_a_missing_task_function_without_a_traceback(tmp_path, capsys):
    rc = main(["run", f"{DIGITS}:no_such_function", "--max-steps", "2", "--timeout", "120",
               "--checkpoint-dir", str(tmp_path / "ck")])
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1][len("RESULT "):])
    assert rc == 1 and res["state"] == "failed" and "has no function 'no_such_function'" in res["error"]
    assert "Traceback" not in cap.err and "no_such_function" in cap.err


def test_run_command_warns_about_schedule_steps_it_never_reached(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ELASTICLAB_PROGRESS", "1")
    rc = main(["run", DIGITS, "--schedule", "3:2,40:1", "--max-steps", "8", "--slots", "2",
               "--checkpoint-dir", str(tmp_path / "ck"), "--timeout", "300"])
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1][len("RESULT "):])
    assert rc == 0 and res["steps"] == 8 and res["schedule_not_reached"] == ["40:1"]
    assert "40:1 never took effect" in cap.err
    assert "training" in cap.err and "step" in cap.err  # the progress bar


def test_run_and_demo_read_the_job_registries(capsys):
    """Issue 15: --on-no-checkpoint offers the job's OnNoCheckpoint values, and the events the commands print
    are kinds of the job's list (records.EVENT_KINDS)."""
    from elasticlab.commands import demo, run
    from elasticlab.elastic.records import EVENT_KINDS
    from elasticlab.elastic.states import OnNoCheckpoint

    assert set(run.PRINTED_EVENTS) <= set(EVENT_KINDS) and set(demo.SHOWN_EVENTS) <= set(EVENT_KINDS)
    with pytest.raises(SystemExit):
        main(["run", DIGITS, "--on-no-checkpoint", "retry"])
    err = capsys.readouterr().err
    assert "invalid choice: 'retry'" in err and all(repr(p.value) in err for p in OnNoCheckpoint), err
