"""P5-T6's experiment (the GNS-guided batch schedule against fixed batches): its mechanics on short runs; the
claim itself runs in test_claims.py."""

from __future__ import annotations

import numpy as np
import pytest

from elasticlab.repro import p5_guided_batch as g
from elasticlab.repro.p5_gns import _threads


@pytest.fixture(scope="module")
def data():
    # a ~30k-parameter model: more torch threads only add synchronisation (many times slower when shared)
    with _threads(1):
        yield g._data()


def test_guided_schedule_grows_in_multiples_and_counts_examples(data):
    r = g.train_to_target(None, seed=0, target=0.0, max_examples=1024, max_batch=32, data=data)
    b = np.array(r["batches"])
    assert r["reached"] is None and r["batch"] == "guided"
    assert r["examples_run"] == b.sum() >= 1024 and r["steps_run"] == len(b)
    assert b[0] == g.INIT_BATCH and np.all(np.diff(b) >= 0) and np.all(b % g.INIT_BATCH == 0)
    assert b.max() <= 32 and b.max() > g.INIT_BATCH            # B_simple (~40-100 here) > 8: it grows
    # a decision every DECIDE_EVERY steps only, at most x2 each
    changes = np.flatnonzero(np.diff(b)) + 1
    assert np.all(changes % g.DECIDE_EVERY == 0) and np.all(b[changes] <= 2 * b[changes - 1])
    assert np.isfinite(r["b_simple"][-1]) and r["b_simple"][-1] > 1
    # one evaluation per EVAL_EVERY examples crossed
    assert len(r["curve"]) == r["examples_run"] // g.EVAL_EVERY


def test_fixed_batch_stops_at_the_target_and_is_deterministic(data):
    easy = g.train_to_target(8, seed=1, target=10.0, max_examples=4096, data=data)
    assert easy["reached"]["examples"] == g.EVAL_EVERY and easy["reached"]["steps"] == g.EVAL_EVERY // 8
    a = g.train_to_target(16, seed=1, target=0.0, max_examples=512, data=data)
    b = g.train_to_target(16, seed=1, target=0.0, max_examples=512, data=data)
    assert a["curve"] == b["curve"] and len(a["curve"]) == 2 and a["curve"][1][1] < a["curve"][0][1]
    assert a["b_simple"] == [] and set(a["batches"]) == {16}


def test_bad_input_is_named(data):
    with pytest.raises(ValueError, match="got 0"):
        g.train_to_target(0, seed=0, target=2.0, max_examples=256, data=data)
    with pytest.raises(ValueError, match="got 4"):
        g.train_to_target(None, seed=0, target=2.0, max_examples=256, max_batch=4, data=data)
