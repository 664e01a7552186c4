"""Unit tests of the elastic runtime's pieces that need no process group: sampler, checkpoints, policies."""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticlab.elastic import (
    BatchConfig,
    CheckpointDir,
    CheckpointError,
    ElasticSampler,
    FixedGlobalBatch,
    FixedPerWorkerBatch,
    GoodputAdaptive,
    check_exactly_once,
)
from elasticlab.elastic import checkpoint as ck
from elasticlab.elastic.sampler import effective_rows, micro_batches
from elasticlab.elastic.task import Task, entrypoint_name


def _simulate(sampler, schedule, batch, rows, gen=0, steps=None):
    """Consume with world sizes from ``schedule`` (one per step), recording rows like the workers do."""
    for world in (schedule if steps is None else schedule[:steps]):
        epoch = sampler.epoch
        step = len({r["step"] for r in rows if r.get("generation", 0) <= gen}) + 1
        for rank in range(world):
            rows.append({"epoch": epoch, "step": step, "rank": rank, "world_size": world, "generation": gen,
                         "indices": sampler.shard(batch, world, rank).tolist()})
        sampler.advance(batch)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), batch=st.integers(1, 64),
       sizes=st.lists(st.integers(1, 8), min_size=1, max_size=40), seed=st.integers(0, 10))
def test_sampler_exactly_once_under_any_resizes(n, batch, sizes, seed):
    s = ElasticSampler(n, seed=seed)
    rows: list = []
    steps_per_epoch = math.ceil(n / batch)
    schedule = [sizes[i % len(sizes)] for i in range(2 * steps_per_epoch)]
    _simulate(s, schedule, batch, rows)
    rep = check_exactly_once(rows, n)
    assert rep["ok"], rep
    assert sorted(rep["epochs"]) == [0, 1]
    assert all(not e["missing"] and not e["duplicates"] for e in rep["epochs"].values())
    # a rank's share differs from the others' by at most one sample
    for step in {r["step"] for r in rows}:
        lens = [len(r["indices"]) for r in rows if r["step"] == step]
        assert max(lens) - min(lens) <= 1


def test_sampler_state_roundtrip_and_checker_catches_errors():
    s = ElasticSampler(100, seed=3)
    s.advance(30)
    t = ElasticSampler(100, seed=0)
    t.load_state_dict(s.state_dict())
    assert np.array_equal(t.step_indices(10), s.step_indices(10))
    assert t.position == 30
    with pytest.raises(ValueError, match="100 samples"):
        ElasticSampler(99).load_state_dict(s.state_dict())
    rows = [{"epoch": 0, "step": 1, "rank": 0, "world_size": 1, "indices": [0, 1, 1]},
            {"epoch": 0, "step": 2, "rank": 0, "world_size": 1, "indices": [2]},
            {"epoch": 1, "step": 3, "rank": 0, "world_size": 1, "indices": [0]}]
    rep = check_exactly_once(rows, 4)
    assert not rep["ok"] and rep["epochs"][0]["duplicates"] == [1] and rep["epochs"][0]["missing"] == [3]
    assert [len(m) for m in micro_batches(np.arange(10), 2)] == [4, 3, 3]
    with pytest.raises(ValueError, match="-1"):
        ElasticSampler(-1)


def test_effective_rows_drop_replayed_steps():
    """Steps run by a generation that then crashed are replayed by the next; only the latest count."""
    s = ElasticSampler(50, seed=1)
    rows: list = []
    _simulate(s, [2] * 4, 5, rows, gen=1)            # steps 1-4 at world 2
    saved = s.state_dict()                           # checkpoint after step 4
    _simulate(s, [3] * 3, 5, rows, gen=1)            # steps 5-7, then a crash
    s.load_state_dict(saved)
    start = len(rows)
    _simulate(s, [1] * 10, 5, rows, gen=2)           # resume from step 4 at world 1
    for r in rows[start:]:
        r["step"] -= 3                               # generation 2 numbers its steps 5, 6, ...
    raw = np.concatenate([r["indices"] for r in rows if r["epoch"] == 0]).astype(int)
    assert np.bincount(raw).max() == 2                       # the raw record holds the replays
    eff = effective_rows(rows)
    assert check_exactly_once(eff, 50)["ok"]
    assert {r["generation"] for r in eff if r["step"] >= 5} == {2}


def test_checkpoint_atomic_checksum_and_fallback(tmp_path):
    d = CheckpointDir(tmp_path, keep=3)
    for step in (5, 10, 15, 20):
        d.save({"step": step, "w": torch.full((3,), float(step))}, step)
    assert d.steps() == [10, 15, 20]                        # only the newest ``keep`` stay
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert ck.load(d.path(20))["w"][0] == 20.0
    # truncate the newest, flip one byte in the one before: both fail their checksum
    p20, p15 = d.path(20), d.path(15)
    p20.write_bytes(p20.read_bytes()[:-7])
    data = bytearray(p15.read_bytes())
    data[-3] ^= 0xFF
    p15.write_bytes(bytes(data))
    for p in (p20, p15):
        with pytest.raises(CheckpointError, match="checksum"):
            ck.load(p)
    best, bad = d.latest()
    assert best == d.path(10) and [b[0] for b in bad] == [p20, p15]
    assert ck.load(best)["step"] == 10
    # at_most: the later ones are passed over, not reported as bad
    assert d.latest(at_most=14) == (d.path(10), [])
    assert d.latest(at_most=9) == (None, [])
    (tmp_path / "ckpt-000000099.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="truncated"):
        ck.load(tmp_path / "ckpt-000000099.pt")


class _Evil:
    pass


def test_checkpoint_loads_weights_only(tmp_path):
    bad = tmp_path / "evil.pt"
    ck.save({"obj": _Evil()}, bad)   # a pickled arbitrary object: refused by weights_only loading
    with pytest.raises(Exception, match="[Ww]eights only"):
        ck.load(bad)


def test_policies():
    assert FixedGlobalBatch(64).decide(3) == BatchConfig(64, 0)
    assert FixedGlobalBatch(64, max_per_worker_batch=16).decide(2) == BatchConfig(64, 1)
    assert FixedGlobalBatch(64).decide(3).per_worker_batch(3) == 22
    assert FixedPerWorkerBatch(16).decide(4) == BatchConfig(64, 0)
    with pytest.raises(ValueError, match="-3"):
        BatchConfig(-3)
    with pytest.raises(ValueError, match="max_batch"):
        GoodputAdaptive(base_batch=64, max_batch=32)
    from elasticlab.goodput import ThroughputModel

    pol = GoodputAdaptive(base_batch=32, max_batch=512, per_worker_range=(8, 128))
    assert pol.decide(2, {"throughput_model": None, "gns": None}) == BatchConfig(32, 0)
    # a compute-bound model with a large noise scale favours big batches
    model = ThroughputModel(0.01, 0.001, 0.005, 0.0005, 0.01, 0.001, 1.0)
    big = pol.decide(2, {"throughput_model": model, "gns": 2000.0})
    small = pol.decide(2, {"throughput_model": model, "gns": 1.0})
    assert big.global_batch > small.global_batch >= 32


def test_entrypoint_names(tmp_path):
    assert entrypoint_name("examples/digits.py").endswith("examples/digits.py:make_task")
    with pytest.raises(ValueError, match="nope.py"):
        entrypoint_name("nope.py:f")

    def local():
        pass

    with pytest.raises(ValueError, match="not importable"):
        entrypoint_name(local)
    with pytest.raises(ValueError, match="empty"):
        Task(model=torch.nn.Linear(1, 1), dataset=(torch.zeros(0, 1),), optimizer=torch.optim.SGD)


def test_job_constructor_rejects_bad_settings(tmp_path):
    from elasticlab.elastic import ElasticJob

    digits = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py")
    cases = [({"workers": 0}, ">= 1, got 0"), ({"workers": 3, "slots": 2}, "3 exceeds the machine's 2"),
             ({"schedule": "4:1,x"}, "bad schedule entry 'x'"),
             ({"schedule": {5: 9}, "slots": 4}, "9 exceeds"),
             ({"epochs": 0}, "epochs must be >= 1, got 0"), ({"device": "tpu"}, "'tpu'"),
             ({"start_method": "fork"}, "'fork'"), ({"warm": 9, "slots": 4}, "warm=9"),
             ({"on_no_checkpoint": "retry"},
              r"on_no_checkpoint must be one of \['restart', 'fail'\], got 'retry'"),
             ({"step_delay_s": -1}, "step_delay_s must be a finite number of seconds >= 0, got -1"),
             ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0, got 0"),
             ({"goodput_refit_s": float("nan")}, "goodput_refit_s must be a finite number of seconds >= 0"),
             ({"threads": 0}, "threads must be an integer >= 1, got 0"),
             ({"epochs": "2"}, "epochs must be >= 1, got '2'"), ({"slots": "4"}, "slots must be a whole"),
             ({"checkpoint_every": -1}, "checkpoint_every must be >= 0, got -1"),
             ({"warm": 1.5}, "warm must be a whole number >= 1, got 1.5"),
             ({"abort_grace_s": "3"}, "abort_grace_s must be a finite number of seconds > 0, got '3'"),
             ({"max_steps": "10"}, "max_steps must be a positive integer, got '10'"),
             ({"seed": -1}, "seed must be a whole number >= 0, got -1"),
             ({"entry_kwargs": "hidden=8"}, "entry_kwargs must be a dict .* got str 'hidden=8'"),
             ({"record_samples": str(tmp_path)}, "is a folder; name the JSONL file"),
             ({"record_samples": str(tmp_path / "no" / "r.jsonl")}, "does not exist")]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ElasticJob(digits, checkpoint_dir=str(tmp_path), **kwargs)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="checkpoint folder .*a-file.* is a file"):
        ElasticJob(digits, checkpoint_dir=str(tmp_path / "a-file" / "ck"))
    job = ElasticJob(digits, checkpoint_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="not been started"):
        job.pause()
    job.stop()                                               # stopping a job never started is fine
    with pytest.raises(RuntimeError, match="stopped"):
        job.resize(1)


def test_single_worker_gns_is_the_same_with_gradient_accumulation():
    """One worker: the per-example GNS update uses every micro-batch's per-example norms, so a step split
    into 4 micro-batches (accumulation) feeds the estimator exactly what one full batch does."""
    import importlib.util
    import pathlib

    from elasticlab.elastic.policies import BatchConfig
    from elasticlab.elastic.worker import Trainer, default_options

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    states = []
    for accum in (0, 3):
        torch.manual_seed(0)
        tr = Trainer(mod.make_task(), default_options())
        tr.set_batch(BatchConfig(32, accum))
        rec, _, mine = tr.train_step()
        assert len(mine) == 32 and rec["accum_steps"] == accum
        assert tr.gns.num_updates == 1, f"accum_steps={accum}: the GNS estimator was not updated"
        states.append((tr.gns.grad_sq, tr.gns.trace_cov, rec["loss"]))
    (g0, s0, l0), (g3, s3, l3) = states
    assert l0 == pytest.approx(l3, rel=1e-6)
    assert s0 == pytest.approx(s3, rel=1e-5) and g0 == pytest.approx(g3, rel=1e-4, abs=1e-9)


def test_job_states_transitions_and_terminal_states_are_shared():
    """Every non-terminal state may fail, terminal states go nowhere, and the live cluster's end states are
    the job's plus its own "dropped"."""
    from elasticlab.cluster.view import TERMINAL as CLUSTER_TERMINAL
    from elasticlab.elastic.states import TERMINAL, TRANSITIONS, JobState, check_transition

    assert set(TRANSITIONS) == set(JobState)
    for s in JobState:
        assert (JobState.FAILED in TRANSITIONS[s]) == (s not in TERMINAL)
        check_transition(s, s)  # setting a state again is always allowed
    for s in TERMINAL:
        assert not TRANSITIONS[s]
    check_transition(JobState.DRAINING, JobState.SPAWNING)
    with pytest.raises(RuntimeError, match="from finished to running"):
        check_transition(JobState.FINISHED, JobState.RUNNING)
    assert set(CLUSTER_TERMINAL) == {*TERMINAL, "dropped"} and "stopped" in CLUSTER_TERMINAL
    assert JobState.RUNNING == "running" and f"{JobState.PAUSED}" == "paused"
    from elasticlab.cluster.view import LiveState

    assert all(isinstance(s, LiveState) for s in CLUSTER_TERMINAL)  # one enum for the cluster's job states
    assert {s for s in LiveState if s in CLUSTER_TERMINAL} == {LiveState(s) for s in TERMINAL} | {"dropped"}
    assert LiveState.QUEUED not in CLUSTER_TERMINAL and str(LiveState.DROPPED) == "dropped"


def test_on_no_checkpoint_policies_live_in_one_enum(tmp_path):
    """The job's policies for "no loadable checkpoint left" are :class:`OnNoCheckpoint` (issue 15): the job
    takes each of its values (plain strings too) and passes the plain value on to its workers."""
    from elasticlab.elastic import ElasticJob
    from elasticlab.elastic.states import OnNoCheckpoint

    assert [p.value for p in OnNoCheckpoint] == ["restart", "fail"]
    digits = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py")
    for value in (*OnNoCheckpoint, "fail"):
        job = ElasticJob(digits, checkpoint_dir=str(tmp_path), on_no_checkpoint=value)
        opt = job.options["on_no_checkpoint"]
        assert opt == value and type(opt) is str
        job.stop()


def test_job_status_is_a_record_read_like_a_dict(tmp_path):
    """status() is a typed record, and the dict-style reads of its callers keep working."""
    import json

    from elasticlab.cluster.torchrun import TorchrunJob
    from elasticlab.elastic import ElasticJob
    from elasticlab.elastic.states import ElasticJobStatus, JobStatus, TorchrunJobStatus

    job = ElasticJob("examples/digits.py:make_task", checkpoint_dir=str(tmp_path), slots=2)
    st = job.status()
    assert isinstance(st, ElasticJobStatus) and isinstance(st, JobStatus)
    assert st["state"] == st.state == "new" and type(st.state) is str and st["step"] == 0
    assert st.get("nope", 7) == 7 and st.get("gns") is None and "lost_steps" in st
    assert set(st.keys()) == {"state", "world_size", "target_world_size", "slots", "generation", "step",
                              "epoch", "loss", "samples_per_s", "global_batch", "accum_steps",
                              "per_worker_batch", "gns", "predicted_goodput", "workers", "lost_steps",
                              "replays", "restarts", "error", "traceback", "checkpoint_dir", "record_samples"}
    assert json.loads(json.dumps({**st})) == st.to_dict() == dict(st) and st == dict(st)
    with pytest.raises(KeyError):
        st["agents"]
    tr = TorchrunJob("examples/digits.py:make_task", workers=1, max_workers=2, checkpoint_dir=str(tmp_path))
    ts = tr.status()
    assert isinstance(ts, TorchrunJobStatus) and ts["agents"] == 0 and ts["state"] == "new"
    assert set(ts) == set(JobStatus.__dataclass_fields__) | {"agents"}


def test_torchrun_job_reports_a_resume_from_pause_as_the_elastic_job_does(tmp_path):
    """Both job handles report a resume from pause as "resumed" (issue 15), a resize as "resize"."""
    from elasticlab.cluster.torchrun import TorchrunJob
    from elasticlab.elastic.records import EVENT_KINDS

    tr = TorchrunJob("examples/digits.py:make_task", workers=1, max_workers=2, checkpoint_dir=str(tmp_path))
    for n, from_size, step in ((2, 1, 5), (2, 0, 9)):
        fut = tr._future(n, from_size)
        tr._on_step({"world_size": n, "step": step})
        assert fut.result(timeout=1)["step"] == step
    resize, resumed = tr.events()
    assert (resize["kind"], resize["from_size"], resize["to_size"]) == ("resize", 1, 2)
    assert (resumed["kind"], resumed["world_size"], resumed["step"]) == ("resumed", 2, 9)
    assert resumed["kind"] in EVENT_KINDS


def test_messages_are_typed_records_that_pickle():
    """The job and its workers exchange the records of messages.py; a control carries its step vector."""
    import pickle

    from elasticlab.elastic import messages as M

    ctl = M.Control(3, M.Command.SET_BATCH, 64, 1)
    assert pickle.loads(pickle.dumps(ctl)) == ctl and ctl.vector == (2, 64, 1)
    assert M.Control(1, M.CMD_LEAVE).vector == (M.CMD_LEAVE, 0, 0)
    join = M.Join(1, 0, 2, 1234, None, "/tmp/x", (32, 0))
    assert pickle.loads(pickle.dumps(join)).batch == (32, 0)
    assert isinstance(pickle.loads(pickle.dumps(M.Exit())), M.Exit)


def test_event_kinds_list_every_event_the_job_emits():
    """records.EVENT_KINDS is the list of the elastic job's events: every ``_events.emit("kind", ...)`` of the
    package names one of them, and each of them is emitted somewhere."""
    import ast
    from pathlib import Path

    import elasticlab.elastic as pkg
    from elasticlab.elastic.records import EVENT_KINDS

    emitted = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            if isinstance(f, ast.Attribute) and f.attr == "emit" and "_events" in ast.unparse(f.value):
                kind = node.args[0]
                assert isinstance(kind, ast.Constant), f"{path.name}:{node.lineno}: emit a literal kind"
                emitted.add(kind.value)
    assert emitted == set(EVENT_KINDS), (emitted ^ set(EVENT_KINDS))
