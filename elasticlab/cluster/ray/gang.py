"""The actors of one Ray job and the placement group of its current allocation.

Each allocation (generation) reserves one placement group: one bundle of the slot resource per rank, each
bundle held to the node the allocator chose by a label selector on ``ray.io/node-id`` (a strict per-node
placement; a rank without a chosen node goes where Ray puts its bundle), all bundles or none. With a custom
slot resource the actors themselves hold no resource: each is pinned to its node (node affinity) and lives
across allocations, so a resize re-reserves the slots and reuses the live actors on the chosen nodes,
starting only the missing ones; up to ``warm`` workers stay alive idle after a shrink (as a local job's warm
processes), holding no slot. With ``resource="GPU"`` an actor must hold its GPU (Ray sets
``CUDA_VISIBLE_DEVICES`` only for an actor that asks for one), so the actors live in the allocation's
bundles and a new allocation starts new actors. ``coupled`` chooses that mode for any resource (default:
``resource == "GPU"``); the tests run it with the custom ``slot`` resource, since no GPU is at hand.
"""
from __future__ import annotations

import contextlib

from elasticlab.cluster.ray.actor import RayWorker


class Gang:
    """The live actors of a job, ``workers`` {id: {"actor", "node"}}, and ``pg``, the placement group of the
    current allocation; see the module docstring."""

    def __init__(self, name: str, resource: str, entrypoint: str, entry_kwargs: dict, options: dict,
                 place_timeout_s: float = 60.0, start_timeout_s: float = 180.0, warm: int = 0,
                 coupled: bool | None = None):
        self.name, self.resource = name, resource
        self.entrypoint, self.entry_kwargs, self.options = entrypoint, entry_kwargs, options
        self.place_timeout_s, self.start_timeout_s = float(place_timeout_s), float(start_timeout_s)
        self.warm = int(warm)
        self.coupled = resource == "GPU" if coupled is None else bool(coupled)  # actors live in bundles
        self.workers: dict[int, dict] = {}
        self.pg = None
        self._next_id = 0

    def choose(self, n: int, plan: list | None, avoid=()) -> tuple[list[int], list]:
        """The live workers to keep for ``n`` ranks and the nodes of the ones to start: by ``plan`` (a node
        id per rank) when it has ``n`` entries, keeping the workers already on its nodes; else the first
        live workers not on a node in ``avoid``, the rest placed by Ray."""
        live = [w for w in sorted(self.workers) if self.workers[w]["node"] not in avoid]
        if not plan or len(plan) != n:
            return live[:n], [None] * (n - min(n, len(live)))
        keep, need = [], list(plan)
        for wid in live:
            node = self.workers[wid]["node"]
            if node in need:
                need.remove(node)
                keep.append(wid)
        return keep, need

    def allocate(self, keep: list[int], need: list, tag: str = "") -> list[int]:
        """Release the previous allocation, reserve this one (a bundle per rank: ``keep``'s nodes, then
        ``need``), start a worker per entry of ``need``; returns the ranks' worker ids (``keep`` first)."""
        if self.coupled:  # the kept actors live in the bundles released now: start them anew
            need, keep = [self.workers[w]["node"] for w in keep] + list(need), []
        self.release()
        nodes = [self.workers[w]["node"] for w in keep] + list(need)
        self.pg = self._reserve(nodes, tag)
        if None in nodes:
            from ray.util.placement_group import placement_group_table

            where = placement_group_table(self.pg).get("bundles_to_node_id", {})
            nodes = [n if n is not None else where.get(i) for i, n in enumerate(nodes)]
        new = self._start(nodes[len(keep):], first_bundle=len(keep)) if len(nodes) > len(keep) else []
        self.trim(keep + new)
        return keep + new

    def _reserve(self, nodes: list, tag: str):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [{self.resource: 1.0} for _ in nodes]
        sel = [{"ray.io/node-id": n} if n else {} for n in nodes] if any(nodes) else None
        pg = placement_group(bundles, strategy="PACK", bundle_label_selector=sel,
                             name=f"elasticlab-{self.name}-{tag}")
        try:
            ray.get(pg.ready(), timeout=self.place_timeout_s)
        except Exception:
            remove_placement_group(pg)
            raise
        return pg

    def _launch(self, nodes: list, first_bundle: int = 0) -> list[int]:
        """Create one actor per entry of ``nodes`` (returns at once; each builds its task in the back)."""
        import ray
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        cls = ray.remote(RayWorker)
        ids = []
        for i, node in enumerate(nodes):
            if self.coupled:
                hold = {"num_gpus": 1} if self.resource == "GPU" else {"resources": {self.resource: 1}}
                how = {**hold, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=first_bundle + i)}
            else:
                how = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
            wid, self._next_id = self._next_id, self._next_id + 1
            actor = cls.options(num_cpus=0, max_concurrency=4, max_restarts=0, **how).remote(
                wid, self.entrypoint, self.entry_kwargs, self.options)
            self.workers[wid] = {"actor": actor, "node": node}
            ids.append(wid)
        return ids

    def _start(self, nodes: list, first_bundle: int) -> list[int]:
        import ray

        ids = self._launch(nodes, first_bundle)
        refs = [self.workers[w]["actor"].where.remote() for w in ids]
        try:
            wheres = ray.get(refs, timeout=self.start_timeout_s)
        except Exception:
            self.kill(ids)
            raise
        for wid, where in zip(ids, wheres):
            self.workers[wid]["node"] = where["node_id"]
        return ids

    def prestart(self, resource_nodes: list[str]) -> list[int]:
        """Start idle workers (no slot held) up to ``warm`` in all, without waiting for them: one on each
        of ``resource_nodes`` in turn, the nodes of the live workers first (as a local job's warm
        processes: a later grow onto those nodes does not wait for an actor to import torch)."""
        if self.coupled:
            return []
        mine = [self.workers[w]["node"] for w in sorted(self.workers)]
        order = [n for n in dict.fromkeys(mine + list(resource_nodes)) if n in resource_nodes]
        ids = []
        k = 0
        while order and len(self.workers) < self.warm:
            ids += self._launch([order[k % len(order)]])
            k += 1
        return ids

    def trim(self, active: list[int]) -> None:
        """Keep at most ``max(warm, len(active))`` workers: end the idle ones beyond that (newest first)."""
        idle = [w for w in sorted(self.workers, reverse=True) if w not in active]
        extra = len(self.workers) - max(self.warm, len(active))
        self.kill(idle[:max(extra, 0)])

    def alive(self, wid: int, timeout: float = 10.0) -> bool:
        import ray

        try:
            ray.get(self.workers[wid]["actor"].where.remote(), timeout=timeout)
            return True
        except Exception:
            return False

    def release(self) -> None:
        """Give the current allocation's slots back (its placement group goes)."""
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
            if self.coupled:
                self.workers.clear()  # they ended with their bundles

    def kill(self, wids) -> None:
        """End these workers."""
        import ray

        for wid in list(wids):
            w = self.workers.pop(wid, None)
            if w is not None:
                with contextlib.suppress(Exception):
                    ray.kill(w["actor"], no_restart=True)

    def close(self) -> None:
        """End every worker and release the slots."""
        self.kill(list(self.workers))
        self.release()
