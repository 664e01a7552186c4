"""elasticlab.checks: the shared strict number checks, and the entry points that use them naming a bad value
(a string or a bool is not a number; a whole number may be written 2 or 2.0)."""
import math

import numpy as np
import pytest

from elasticlab.checks import number, seconds, whole


@pytest.mark.parametrize("value", ["3", b"3", True, None, [1], float("nan"), float("inf"), -math.inf])
def test_number_rejects_non_numbers_and_non_finite(value):
    with pytest.raises(ValueError) as e:
        number("x", value)
    assert str(e.value) == f"x must be a finite number, got {value!r}"


def test_number_accepts_real_numbers_and_applies_the_bound():
    assert number("x", 3) == 3.0 and isinstance(number("x", np.float32(0.5)), float)
    assert number("x", np.int64(7)) == 7.0
    with pytest.raises(ValueError, match="x must be positive, got -1"):
        number("x", -1, lambda v: v > 0, "positive")
    assert seconds("t", 0, zero_ok=True) == 0.0
    with pytest.raises(ValueError, match="t must be a finite number of seconds > 0, got 0"):
        seconds("t", 0)


@pytest.mark.parametrize("value", ["2", True, 2.5, float("nan"), 0, -1, None])
def test_whole_rejects(value):
    with pytest.raises(ValueError, match=r"n must be a whole number >= 1, got "):
        whole("n", value, 1)


def test_whole_accepts_integral_values():
    assert whole("n", 2.0, 1) == 2 and type(whole("n", 2.0, 1)) is int
    assert whole("n", np.int32(5), 0) == 5


@pytest.mark.parametrize("make, msg", [
    (lambda: __import__("elasticlab.elastic.policies", fromlist=["x"]).BatchConfig("64"),
     "global_batch must be a positive integer, got '64'"),
    (lambda: __import__("elasticlab.elastic.sampler", fromlist=["x"]).ElasticSampler(10, seed=-1),
     "seed must be a whole number >= 0, got -1"),
    (lambda: __import__("elasticlab.elastic.sampler", fromlist=["x"]).ElasticSampler("ten"),
     "num_samples must be a positive integer, got 'ten'"),
    (lambda: __import__("elasticlab.alloc.policies.base", fromlist=["x"]).Cluster.of_capacity("8"),
     "capacity must be a whole number of GPUs >= 1, got '8'"),
    (lambda: __import__("elasticlab.lr.dynamic_sgd", fromlist=["x"]).DynamicSGD(steps_per_k=float("nan")),
     "steps_per_k must be a finite number >= 0, got nan"),
    (lambda: __import__("elasticlab.sim.checks", fromlist=["x"]).check_seed("3"),
     "seed must be a whole number >= 0, got '3'"),
])
def test_entry_points_name_a_string_or_bad_value(make, msg):
    """Before: a string gave "invalid literal for int()" or a TypeError from a comparison."""
    with pytest.raises(ValueError, match=msg):
        make()


def test_batch_config_keeps_integers():
    from elasticlab.elastic.policies import BatchConfig

    b = BatchConfig(64.0, 1.0)
    assert type(b.global_batch) is int and type(b.accum_steps) is int and b.per_worker_batch(2) == 16
