"""Cluster simulator: replays the Pollux artifact's traces and whole cluster traces (engine) and Saxena-style
synthetic workloads. Names load on first use (the CLI checks its flags through :mod:`.checks` without
importing the engine)."""
import importlib

_WHERE = {"simulate": "engine", "make_jobs": "engine", "SimJob": "job", "SimResult": "metrics",
          "summarize": "metrics", "Application": "traces", "load_application": "traces",
          "load_workload": "workload", "trace_workload": "trace_workload", "read_trace": "trace_workload"}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'elasticlab.sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"elasticlab.sim.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
