"""``GradientNoiseScale``: a PyTorch Lightning ``Callback`` measuring the GNS with :class:`GNSMonitor`.

One optimizer step is the window from the first ``on_train_batch_start`` of an accumulation window to
``on_before_optimizer_step`` (after the last backward, before clipping and the step; under
``precision="16-mixed"`` the precision plugin's GradScaler is handed to the monitor). Under the DDP strategy
the monitor wraps the strategy's ``DistributedDataParallel`` model (replica form); with
``accumulate_grad_batches`` > 1 the micro-batch form; otherwise per-example norms. Logs ``gns/b_simple``,
``gns/grad_sq``, ``gns/trace_cov`` (per layer with ``log_layers``) through the LightningModule's logger.
"""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.data import extract_batch_size
from torch import nn

from elasticlab.gns import GNSMonitor
from elasticlab.gns.forms import check_settings
from elasticlab.integrations.common import metrics


class GradientNoiseScale(pl.Callback):
    """``every``: measure one optimizer step in ``every``; ``beta``, ``method``: :class:`GNSMonitor`'s.
    ``controller``: a :class:`~elasticlab.integrations.BatchSizeController`, asked at each measured step
    (its proposal is logged and kept in ``history``; the data loader is yours to change).
    ``history``: the monitor's, one dict per measured step (``step`` = the trainer's global step)."""

    def __init__(self, every: int = 1, beta: float = 0.99, method: str = "auto", log_layers: bool = False,
                 controller=None, prog_bar: bool = False):
        super().__init__()
        every = check_settings(every, beta, method)
        self.every, self.beta, self.method, self.log_layers = every, beta, method, log_layers
        self.controller, self.prog_bar = controller, prog_bar
        self.monitor: GNSMonitor | None = None
        self._open, self._pending = False, None

    @property
    def history(self) -> list[dict]:
        return [] if self.monitor is None else self.monitor.history

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            return                                             # a second fit() continues the same estimate
        model = trainer.strategy.model
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            model = pl_module
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        mesh = getattr(trainer.strategy, "device_mesh", None)  # ModelParallelStrategy: the examples differ
        group = mesh["data_parallel"].get_group() if mesh is not None and "data_parallel" in (
            mesh.mesh_dim_names or ()) else None                 # over its data-parallel dimension alone
        self.monitor = GNSMonitor(model, every=self.every, beta=self.beta, method=self.method,
                                  grad_scaler=scaler, per_layer=self.log_layers, accumulation="mean",
                                  process_group=group)
        if self._pending:                                      # restored from a checkpoint before the fit
            self.monitor.load_state_dict(self._pending)
            self._pending = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not self._open:
            self.monitor.begin()
            self._open = True
        self.monitor.micro_batch(extract_batch_size(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._open:
            return
        self._open = False
        rec = self.monitor.end(step=trainer.global_step + 1)
        if rec is not None:
            m = metrics(rec, self.log_layers, self.controller, self.monitor)
            if m:
                pl_module.log_dict(m, on_step=True, on_epoch=False, prog_bar=self.prog_bar)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._open:                                         # a window that never reached its step
            self.monitor.abort()
            self._open = False

    def state_dict(self) -> dict:
        return {} if self.monitor is None else self.monitor.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict
