"""``GradientNoiseScaleCallback``: a Hugging Face ``transformers.TrainerCallback`` measuring the GNS.

One optimizer step is ``on_step_begin`` .. ``on_pre_optimizer_step``; the monitor reads the gradients at
the end of each backward, before the Trainer clips them. The micro-batch sizes come from the model's
forward (dim 0 of ``input_ids``), and with ``gradient_accumulation_steps`` > 1 the micro-batch form is used
(the Trainer divides each micro-batch's loss by the step's token count: ``accumulation="mean"`` for equal
micro-batches). Each measured step adds ``gns/b_simple``, ``gns/grad_sq``, ``gns/trace_cov`` to
``state.log_history`` and, when ``report_to`` names ``tensorboard`` and it is installed, to TensorBoard.
``transformers``' ``Conv1D`` (GPT-2's projections) has the Linear rule, registered by name in
:mod:`elasticlab.gns.layers.linear` (with or without this module).
"""
from __future__ import annotations

from transformers import TrainerCallback

from elasticlab.gns import GNSMonitor
from elasticlab.gns.forms import check_settings
from elasticlab.integrations.common import metrics


class GradientNoiseScaleCallback(TrainerCallback):
    """``every``, ``beta``, ``method``: :class:`GNSMonitor`'s; ``log_layers``: per-module B_simple too;
    ``controller``: a :class:`~elasticlab.integrations.BatchSizeController` asked at each measured step.
    ``history``: the monitor's, one dict per measured step (``step`` = the Trainer's global step)."""

    def __init__(self, every: int = 1, beta: float = 0.99, method: str = "auto", log_layers: bool = False,
                 controller=None):
        every = check_settings(every, beta, method)
        self.every, self.beta, self.method, self.log_layers = every, beta, method, log_layers
        self.controller = controller
        self.monitor: GNSMonitor | None = None
        self._open, self._writer = False, None

    @property
    def history(self) -> list[dict]:
        return [] if self.monitor is None else self.monitor.history

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.monitor is None:
            if model is None:
                raise ValueError("GradientNoiseScaleCallback: the Trainer passed no model to on_train_begin")
            self.monitor = GNSMonitor(model, every=self.every, beta=self.beta, method=self.method,
                                      per_layer=self.log_layers, accumulation="mean")
        report = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
        if state.is_world_process_zero and ("tensorboard" in report or "all" in report):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._writer = None
            else:
                self._writer = SummaryWriter(log_dir=args.logging_dir)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._open:
            self.monitor.begin()
            self._open = True

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self._open:
            return
        self._open = False
        rec = self.monitor.end(step=state.global_step + 1)
        if rec is None:
            return
        m = metrics(rec, self.log_layers, self.controller, self.monitor)
        if m and state.is_world_process_zero:
            state.log_history.append({**m, "step": rec["step"]})
            if self._writer is not None:
                for k, v in m.items():
                    self._writer.add_scalar(k, v, rec["step"])

    def on_train_end(self, args, state, control, **kwargs):
        if self._open:
            self.monitor.abort()
            self._open = False
        if self._writer is not None:
            self._writer.close()
            self._writer = None
