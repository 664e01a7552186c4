"""elasticlab.checks: the shared strict number checks, and the entry points that use them naming a bad value
(a string or a bool is not a number; a whole number may be written 2 or 2.0)."""
import math

import numpy as np
import pytest

from elasticlab.alloc.policies.base import Cluster
from elasticlab.checks import number, seconds, whole
from elasticlab.cluster import RestartCost
from elasticlab.elastic import ElasticSampler, FixedGlobalBatch, FixedPerWorkerBatch, GoodputAdaptive
from elasticlab.elastic.policies import BatchConfig
from elasticlab.integrations import BatchSizeController
from elasticlab.lr import AdaScale, AdaScaleEstimator, DynamicSGD, ScaleInvariantProgress
from elasticlab.sim.checks import check_seed


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
    (lambda: BatchConfig("64"), "global_batch must be a positive integer, got '64'"),
    (lambda: ElasticSampler(10, seed=-1), "seed must be a whole number >= 0, got -1"),
    (lambda: ElasticSampler("ten"), "num_samples must be a positive integer, got 'ten'"),
    (lambda: Cluster.of_capacity("8"), "capacity must be a whole number of GPUs >= 1, got '8'"),
    (lambda: DynamicSGD(steps_per_k=float("nan")), "steps_per_k must be a finite number >= 0, got nan"),
    (lambda: check_seed("3"), "seed must be a whole number >= 0, got '3'"),
    (lambda: FixedGlobalBatch("64"), "global_batch must be a positive integer, got '64'"),
    (lambda: FixedPerWorkerBatch(16, ramp_per_k=-1), "ramp_per_k must be a finite number of steps >= 0"),
    (lambda: GoodputAdaptive("32", 256), "base_batch must be a positive integer, got '32'"),
    (lambda: GoodputAdaptive(32, 256, hysteresis=0.5), "hysteresis must be a finite factor >= 1, got 0.5"),
    (lambda: GoodputAdaptive(32, 256, per_worker_range=(0, 8)), r"per_worker_range must be 1 <= lo <= hi"),
    (lambda: AdaScaleEstimator("x"), "base_batch must be a finite number > 0, got 'x'"),
    (lambda: AdaScale(power="x"), "power must be a finite number > 0, got 'x'"),
    (lambda: ScaleInvariantProgress(float("inf")), "init_batch must be a finite number > 0, got inf"),
    (lambda: BatchSizeController(16, 512, fraction="x"), "fraction must be a positive number, got 'x'"),
    (lambda: BatchSizeController(16, 512, ramp_per_k=float("nan")), "ramp_per_k must be a finite number"),
    (lambda: BatchSizeController(16.0, 512, min_batch=True), "min_batch must be an integer >= 1, got True"),
    (lambda: RestartCost(prior_s="x"), "prior_s must be a finite number of seconds >= 0, got 'x'"),
])
def test_entry_points_name_a_string_or_bad_value(make, msg):
    """Before: a string gave "invalid literal for int()" or a TypeError from a comparison, and some bad
    values (a negative ramp, a NaN batch, a hysteresis below 1) were accepted."""
    with pytest.raises(ValueError, match=msg):
        make()


def test_batch_config_keeps_integers():
    b = BatchConfig(64.0, 1.0)
    assert type(b.global_batch) is int and type(b.accum_steps) is int and b.per_worker_batch(2) == 16


def test_array_inputs_name_the_argument():
    from elasticlab.alloc import allocation_value
    from elasticlab.goodput import efficiency

    with pytest.raises(ValueError, match=r"phi \(gradient noise scale\) must be a number or an array"):
        efficiency("x", 32, 64)
    with pytest.raises(ValueError, match=r"m0 \(initial batch size\) must be a number or an array"):
        efficiency(10.0, "thirty-two", 64)
    u = np.ones((2, 3))
    with pytest.raises(ValueError, match=r"alloc entries must be in \[0, 2\].*got \[1, 5\]"):
        allocation_value(u, [1, 5])                    # was an IndexError
    with pytest.raises(ValueError, match="one GPU count per row"):
        allocation_value(u, [1])
    assert allocation_value(u, [1, 2]) == 2.0 and allocation_value(u, []) == 0.0


def test_whole_with_an_upper_bound():
    assert whole("n", 6, 1, most=6) == 6
    with pytest.raises(ValueError, match=r"n must be a whole number in \[1, 6\], got 7"):
        whole("n", 7, 1, most=6)
