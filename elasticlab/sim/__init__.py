"""Cluster simulator: replays the Pollux artifact's traces (engine) and Saxena-style synthetic workloads."""
from elasticlab.sim.engine import make_jobs, simulate
from elasticlab.sim.job import SimJob
from elasticlab.sim.metrics import SimResult, summarize
from elasticlab.sim.traces import Application, load_application
from elasticlab.sim.workload import load_workload

__all__ = ["simulate", "make_jobs", "SimJob", "SimResult", "summarize", "Application", "load_application",
           "load_workload"]
