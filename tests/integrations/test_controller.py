"""BatchSizeController: batch from B_simple (growth, rounding within the range, hysteresis, never shrinking),
from goodput, LR multipliers of the elasticlab.lr rules, and the plain-loop use with GNSMonitor (AdaScale fed
the monitor given to step)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import GNSMonitor
from elasticlab.goodput import ThroughputModel, gain
from elasticlab.integrations import BatchSizeController


def test_follows_b_simple_with_growth_cap_rounding_hysteresis_and_no_shrinking():
    ctl = BatchSizeController(init_batch=16, max_batch=256, lr_rule="sqrt", multiple_of=8)
    p = ctl.step(math.nan)
    assert p.batch == 16 and not p.changed and "no GNS" in p.reason
    seq = [ctl.step(100.0).batch for _ in range(4)]
    assert seq == [32, 64, 96, 96]                     # x2 per decision, then 100 rounded down to 8s
    assert ctl.step(101.0).batch == 96                 # within the 10% hysteresis
    assert ctl.step(20.0).batch == 96                  # never shrinks
    assert ctl.step(float("inf")).batch == 192 and ctl.step(1e9).batch == 256    # capped at max_batch
    assert ctl.proposals[-1].lr_multiplier == pytest.approx(math.sqrt(256 / 16))


def test_lr_multipliers_of_the_rules():
    for rule, expect in (("linear", 4.0), ("sqrt", 2.0), ("constant", 1.0), ("dynamic_sgd", 4.0)):
        assert BatchSizeController(16, 256, lr_rule=rule).lr_multiplier(64) == pytest.approx(expect)
    ada = BatchSizeController(16, 256, lr_rule="adascale")
    assert ada.lr_multiplier(64, gns=30.0) == pytest.approx(float(gain(30.0, 16, 64)))
    with pytest.raises(ValueError, match="unknown LR rule"):
        BatchSizeController(16, 256, lr_rule="cubic")
    with pytest.raises(ValueError, match="init_batch <= max_batch"):
        BatchSizeController(64, 32)
    with pytest.raises(ValueError, match="max_growth"):
        BatchSizeController(16, 64, max_growth=1.0)


def test_goodput_mode_grows_only_when_the_noise_allows():
    # a step costs the same at any batch up to 64 per GPU: throughput grows with the batch
    model = ThroughputModel(alpha_grad=1.0, beta_grad=1e-4)
    noisy = BatchSizeController(16, 512, throughput_model=model, max_per_gpu_batch=512, hysteresis=0.0)
    quiet = BatchSizeController(16, 512, throughput_model=model, max_per_gpu_batch=512, hysteresis=0.0)
    assert noisy.propose(1e4).batch > 256               # lots of gradient noise: a big batch is efficient
    assert quiet.propose(1e-3).batch < 32               # almost none: the initial batch is best


def test_plain_loop_with_monitor_and_elastic_lr():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = GNSMonitor(model, beta=0.9)
    ctl = BatchSizeController(init_batch=8, max_batch=128, lr_rule="linear", multiple_of=8)
    elr = ctl.elastic_lr(opt)
    x, w = torch.randn(2048, 5), torch.randn(5, 4)
    y = (x @ w + 2.0 * torch.randn(2048, 4)).argmax(1)             # noisy labels: a large GNS
    i, batches = 0, []
    for _ in range(12):
        b = ctl.batch
        xb, yb = x[i:i + b], y[i:i + b]
        i += b
        opt.zero_grad()
        with mon.step():
            F.cross_entropy(model(xb), yb).backward()
        with elr.applied() as lrs:
            opt.step()
        batches.append((b, lrs[0]))
        ctl.step(mon)
    assert batches[0] == (8, pytest.approx(0.05))
    assert batches[-1][0] > 8 and batches[-1][1] == pytest.approx(0.05 * batches[-1][0] / 8)
    assert all(b % 8 == 0 for b, _ in batches) and [b for b, _ in batches] == sorted(b for b, _ in batches)
    assert len(mon.history) == 12 and mon.history[-1]["batch_size"] == batches[-1][0]


def test_rounding_stays_in_range_and_never_below_the_current_batch():
    # an initial batch (the minimum) that is not a multiple: 31 rounds down to 24, below both; it goes up to
    # the first multiple at or above the minimum (32), which the hysteresis keeps at 30
    ctl = BatchSizeController(init_batch=30, max_batch=1000, multiple_of=8)
    assert [ctl.step(31.0).batch, ctl.step(33.0).batch, ctl.step(31.0).batch] == [30, 30, 30]
    assert ctl.step(45.0).batch == 40                  # then rounded down as before
    free = BatchSizeController(init_batch=30, max_batch=1000, min_batch=10, multiple_of=8, monotone=False)
    assert free.step(12.0).batch == 16                 # below the current batch, not below min_batch
    with pytest.raises(ValueError, match=r"no multiple of multiple_of=8 lies in \[min_batch, max_batch\]"):
        BatchSizeController(init_batch=4, max_batch=6, multiple_of=8)


def test_adascale_elastic_lr_reads_the_monitor_given_to_step():
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = GNSMonitor(model, beta=0.9)
    ctl = BatchSizeController(init_batch=8, max_batch=1024, lr_rule="adascale", multiple_of=8)
    elr = ctl.elastic_lr(opt)                          # no gns given: the controller feeds it what step gets
    w, used, proposed = torch.randn(10, 1), [], []
    for _ in range(6):
        x = torch.randn(ctl.batch, 10)
        opt.zero_grad()
        with mon.step():
            F.mse_loss(model(x), x @ w + 3.0 * torch.randn(ctl.batch, 1)).backward()
        with elr.applied() as lrs:
            opt.step()
        used.append((x.shape[0], lrs[0] / 0.1))
        proposed.append(ctl.step(mon))
    assert used[-1][0] > 8                             # the batch grew, and the LR with AdaScale's gain
    for (b, m), p in zip(used[1:], proposed[:-1]):
        assert p.batch == b and m == pytest.approx(p.lr_multiplier, rel=0.2)   # (the EMA moves a little)
    assert used[-1][1] > 1.2
