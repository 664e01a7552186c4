"""Benchmark of the cluster autoscaler: average JCT of three real jobs per policy, locally or on Ray.

The three jobs of :func:`elasticlab.cluster.experiments.three_jobs` (a communication-bound tiny model, a
compute-bound MLP, a job whose gradient noise scale grows fast; emulated device times, real training) run
under each policy in turn; the baseline (fixed equal shares) is measured in the same run.

* ``--backend local`` (default): a :class:`~elasticlab.cluster.LocalCluster` of ``--slots`` slots.
* ``--backend ray``: a :class:`~elasticlab.cluster.ray.RayCluster` over a local ``ray.cluster_utils.Cluster``
  of ``--nodes`` x ``--slots-per-node`` (custom resource ``slot``); ``--kill-node-at S`` removes a worker
  node on which a job trains, from S seconds into each policy's run on (added back before the next);
  ``--record-samples DIR`` writes each job's sample record to ``DIR/<policy>/<job>.jsonl`` (the schema of
  ``elasticlab run --record-samples``, one run per file: each policy runs every job again, so the records
  are kept apart by policy rather than all in ``DIR/<job>.jsonl``).

Reported per policy: average and per-job JCT (s), makespan, resizes, the measured restart cost, the ratio of
each policy's average JCT to equal shares (< 1 is better) and, on Ray, the resize latencies (median, shrinks,
grows), faults and replayed steps. ``--quick`` halves the work.
Last line: RESULT {json} with ``<policy>_avg_jct`` keys (goodput_avg_jct, equal_share_avg_jct, ...).
"""
from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("ELASTICLAB_QUICK") == "1")
    ap.add_argument("--policies", default="equal_share,goodput,pollux,saxena,fifo",
                    help="comma-separated; equal_share (the baseline) is always run")
    ap.add_argument("--backend", choices=("local", "ray"), default="local")
    ap.add_argument("--slots", type=int, default=4, help="local backend: slots of the pool")
    ap.add_argument("--nodes", type=int, default=3, help="ray backend: nodes")
    ap.add_argument("--slots-per-node", type=int, default=2, help="ray backend: slots per node")
    ap.add_argument("--kill-node-at", type=float, default=None, metavar="S",
                    help="ray backend: remove a worker node S seconds into each policy's run")
    ap.add_argument("--record-samples", default=None, metavar="DIR",
                    help="ray backend: write each job's sample record to DIR/<policy>/<job>.jsonl (one "
                         "run per file, as `elasticlab run --record-samples` writes it)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    pols = [p.strip() for p in a.policies.split(",") if p.strip()]
    if "equal_share" not in pols:
        pols.insert(0, "equal_share")
    if a.backend == "local":
        if a.kill_node_at is not None or a.record_samples is not None:
            ap.error("--kill-node-at and --record-samples need --backend ray")
        from elasticlab.cluster.experiments import compare_policies

        out = compare_policies(pols, quick=a.quick, slots=a.slots, interval=a.interval, timeout=a.timeout,
                               progress=True)
        result = {"backend": "local", "slots": a.slots, "quick": a.quick, "interval_s": a.interval}
    else:
        if a.kill_node_at is not None and not a.kill_node_at >= 0:
            ap.error(f"--kill-node-at must be >= 0 seconds, got {a.kill_node_at}")
        if a.kill_node_at is not None and a.nodes < 2:
            ap.error(f"--kill-node-at needs --nodes >= 2 (the head node stays), got {a.nodes}")
        from elasticlab.cluster.ray.experiments import compare_on_ray, median

        out = compare_on_ray(pols, nodes=a.nodes, slots_per_node=a.slots_per_node, quick=a.quick,
                             interval=a.interval, timeout=a.timeout, kill_node_at=a.kill_node_at,
                             record_dir=a.record_samples, progress=True)
        result = {"backend": "ray", "nodes": a.nodes, "slots_per_node": a.slots_per_node,
                  "slots": a.nodes * a.slots_per_node, "quick": a.quick, "interval_s": a.interval,
                  "killed_node_at": a.kill_node_at}
    base = out["equal_share_avg_jct"]
    for p in pols:
        run = out["runs"][p]
        avg = run["avg_jct"]
        result[f"{p}_avg_jct"] = avg
        result[f"{p}_jct"] = run["jct"]
        result[f"{p}_makespan"] = run["makespan"]
        result[f"{p}_all_finished"] = all(s == "finished" for s in run["states"].values())
        result[f"{p}_samples_exactly_once"] = all(run.get("samples_ok", {}).values())
        result[f"{p}_restart_cost_s"] = run["restart_cost"]["estimate_s"]
        result[f"{p}_resizes"] = sum(run["restarts"].values())
        if avg is not None and base:
            result[f"{p}_vs_equal_share"] = avg / base
        extra = ""
        if a.backend == "ray":
            lat = run["resize_latency_s"]
            result[f"{p}_resize_latency_s"] = median(lat["all"])
            result[f"{p}_shrink_latency_s"] = median(lat["shrink"])
            result[f"{p}_grow_latency_s"] = median(lat["grow"])
            result[f"{p}_resize_latencies_s"] = lat["all"]
            result[f"{p}_faults"] = run["faults"]
            result[f"{p}_lost_steps"] = run["lost_steps"]
            result[f"{p}_killed"] = run["killed"]
            extra = (f"  resize latency median {result[f'{p}_resize_latency_s']} s (shrink "
                     f"{result[f'{p}_shrink_latency_s']}, grow {result[f'{p}_grow_latency_s']})  faults "
                     f"{run['faults']}  replayed steps {run['lost_steps']}")
        jobs = ", ".join(f"{k} {v:.1f}s" for k, v in run["jct"].items())
        mk = run["makespan"]
        print(f"{p:12s} avg JCT {avg if avg is None else round(avg, 2)} s  ({jobs})  "
              f"makespan {mk if mk is None else round(mk, 1)}s  resizes {result[f'{p}_resizes']}  "
              f"restart cost {result[f'{p}_restart_cost_s']:.2f}s" + extra, flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
