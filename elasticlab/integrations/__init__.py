"""The gradient noise scale where training already happens: callbacks for PyTorch Lightning
(:mod:`~elasticlab.integrations.lightning`, the ``lightning`` package) and the Hugging Face ``Trainer``
(:mod:`~elasticlab.integrations.transformers`), both over :class:`elasticlab.gns.GNSMonitor`, and
:class:`~elasticlab.integrations.controller.BatchSizeController`, which turns the measured GNS into the next
batch size and LR. The callbacks' modules import their frameworks; this package imports neither
(``pip install 'elasticlab[integrations]'``).
"""
from elasticlab.integrations.controller import BatchSizeController, Proposal

__all__ = ["BatchSizeController", "Proposal"]
