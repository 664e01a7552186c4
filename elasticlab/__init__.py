"""elasticlab: elastic deep-learning training research toolkit.

Subpackages (see ARCHITECTURE.md): ``gns`` (per-example gradient norms, gradient noise scale),
``goodput`` and ``lr`` (Pollux's goodput model, LR rules), ``alloc`` and ``sim`` (allocation policies,
cluster simulator), ``elastic`` (live-resizing DDP jobs), ``cluster`` (local autoscaler),
``dynamics`` (learning dynamics theory), ``widgets`` (Jupyter panels), ``repro`` (paper reproductions).
"""
__version__ = "0.1.0"
