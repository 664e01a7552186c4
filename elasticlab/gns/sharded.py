"""Gradients sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): norms of the whole gradient.

Under FSDP2 a parameter and its ``.grad`` are DTensors, each process holding a shard; the per-example norms
need nothing of this (they come from each layer's activations and output gradients, whole in the forward),
but ‖ḡ‖² does: Σ g² of a DTensor's local shard, summed over the mesh dimensions it is sharded along
(replicated dimensions hold the same values and are not summed). The sharded parameters are not in the
autograd graph (the forward runs on their unsharded copies), so hooks on them never fire: a backward is seen
at a forward's output instead (:meth:`~elasticlab.gns.capture.StepGradients.watch`).

Tensor parallelism (``parallelize_module``'s ColwiseParallel / RowwiseParallel on ``nn.Linear``): the layer's
weight stays a DTensor in its forward; each process's per-example norms are those of its shard of the weight,
from its shards of the input and of the output gradient, summed over the mesh dimensions the weight is sharded
along (:func:`tensor_parallel`, :func:`reduce_norms`).
"""
from __future__ import annotations

import re
import weakref

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:                                       # (torch without distributed)
    DTensor = ()

PER_EXAMPLE_ONLY = ("GNSMonitor: an FSDP2 (fully_shard) or tensor-parallel model is measured by its "
                    "per-example norms, over every micro-batch of a step (the micro-batch form needs each "
                    "backward's whole gradient, which FSDP2 reduces away), but {}")


#: transformers' ``DistributedConfig`` settings the monitor cannot measure under, and why
HF_REFUSED = {"pp_size": "pipeline parallelism: each process holds some of the layers, and their per-example "
                         "norms are not summed over the stages",
              "ep_size": "expert parallelism: each process's experts run tokens of other processes' examples"}


def refuse_unsupported(model) -> None:
    """A clear error for FSDP1 (``FullyShardedDataParallel``): its flat parameters' gradients never reach the
    hooks the norms and the monitor read them by, so every step would go unmeasured; and for the settings of
    transformers' ``DistributedConfig`` in :data:`HF_REFUSED`."""
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    for name, why in HF_REFUSED.items():
        if (getattr(config, name, None) or 1) > 1:
            raise ValueError(f"GNSMonitor: the model was loaded with DistributedConfig({name}="
                             f"{getattr(config, name)}): {why}, which is not supported; measure it under "
                             "fsdp_size, dp_replicate_size and tp_size")
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        return
    if any(isinstance(m, FSDP1) for m in model.modules()):
        raise ValueError("GNSMonitor: FSDP1 (FullyShardedDataParallel) is not supported: shard the model "
                         "with FSDP2's torch.distributed.fsdp.fully_shard instead, which the monitor "
                         "measures per example (Lightning: ModelParallelStrategy, fully_shard in "
                         "configure_model; HF Trainer/Accelerate: fsdp_config={'version': 2}), or measure it "
                         "unsharded, or under DDP")


def watched(model) -> list:
    """``model`` and its outermost FSDP2 units: the modules whose outputs show a backward through sharded
    parameters (every sharded parameter lives in a unit), also where the model's own forward never runs (a
    LightningModule's ``training_step`` calling a submodule)."""
    from torch.distributed.fsdp import FSDPModule
    out = [model]

    def visit(m):
        for c in m.children():
            if isinstance(c, FSDPModule):
                out.append(c)
            else:
                visit(c)
    if not isinstance(model, FSDPModule):
        visit(model)
    return out


#: The layers whose tensor-parallel shards have per-example norms (:func:`tensor_parallel`).
TP_LAYERS = (torch.nn.Linear, torch.nn.Embedding)


def refuse_distributed_weights(slot) -> None:
    """A clear error for a layer other than those of :data:`TP_LAYERS` (:func:`tensor_parallel`) whose
    parameters are still DTensors in its forward (tensor parallelism, as ``parallelize_module`` leaves them;
    FSDP2's alone are whole there): its per-example norms would need a rule of its own."""
    names = [n for n in slot.need if isinstance(slot.module._parameters.get(n), DTensor)]
    if names and not slot.tp and not _fsdp_resharded(slot.module, names):
        raise ValueError(f"module {slot.name!r} ({type(slot.module).__name__}): its parameters {names} are "
                         "DTensors in its forward (tensor parallelism), for which per-example gradient norms "
                         "are supported on nn.Linear and nn.Embedding (ColwiseParallel, RowwiseParallel, "
                         "sharded along one mesh dimension); measure this layer replicated, or the model "
                         "under data parallelism")


def _records(unit) -> dict:
    """FSDP2's parameter records of ``unit`` by (id of a module, parameter name), a shared parameter under
    each of its modules (a private API: the callers catch AttributeError and KeyError). Not by the parameter
    itself: transformers' own FSDP loads the weights into new parameters after ``fully_shard``, which FSDP2
    puts back by its own at the first forward."""
    out = {}
    for g in unit._get_fsdp_state()._fsdp_param_groups:
        for fp in g.fsdp_params:
            info = fp._module_info
            for m, n in ((info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)):
                out[(id(m), n)] = fp
    return out


def _fsdp_resharded(module, names) -> bool:
    """Whether ``module``'s parameters ``names`` are DTensors at its forward hooks only because it is an FSDP2
    unit of its own that resharded them after its forward, before those hooks ran (a leaf unit:
    transformers' own FSDP gives the input embedding one), not tensor-parallel there."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(module, FSDPModule):
        return False
    try:
        records = _records(module)
        return not any(records[(id(module), n)].is_dtensor for n in names)
    except (AttributeError, KeyError):
        return False


#: transformers' own tensor-parallel styles (``model.tp_plan``) whose per-example norms are checked against
#: one process's (tests/integrations/test_transformers_tp.py); a module given another is refused by name.
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise",
             "replicate")


def hf_style(model, slot) -> str | None:
    """The style transformers' tensor parallelism gave ``slot``'s module or one of its parameters (an entry
    of ``model.tp_plan``, ``*`` a layer number), when ``model`` is split over more than one process; else
    None."""
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    names = {slot.name, *(f"{slot.name}.{p}" for p in slot.need)}
    for pattern, style in (getattr(model, "tp_plan", None) or {}).items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        if any(rx.fullmatch(n) for n in names):
            return style
    return None


#: Modules whose parameters are whole on every process while each process's gradient of them is a part of
#: the whole (transformers' ``replicated_with_grad_allreduce``: Qwen3's per-head norms, each process seeing
#: its own heads), with the group that sums the parts: the generic rule sums the per-example gradients over it
#: before it takes their norms (:func:`elasticlab.gns.layers.generic.summed_norms`).
PARTIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tp_group(model):
    """The tensor-parallel group of a model transformers split (its mesh: a private attribute, read
    defensively), or None."""
    mesh = getattr(model, "_device_mesh", None)
    try:
        return (mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else mesh).get_group()
    except (AttributeError, KeyError, RuntimeError, TypeError):
        return None


def refuse_hf_style(model, slot) -> None:
    """A clear error for a module given a style of transformers' tensor parallelism whose per-example norms
    are not checked; a ``replicated_with_grad_allreduce`` module on the generic rule goes in
    :data:`PARTIAL`."""
    style = hf_style(model, slot)
    if style is None or style in HF_STYLES:
        return
    if style == "replicated_with_grad_allreduce":
        from elasticlab.gns.layers.generic import generic_norms
        group = _tp_group(model)
        if group is not None and slot.rule.norms is generic_norms:
            PARTIAL[slot.module] = group
            return
    why = ("its parameters stay whole on every process while each process's gradient covers only its share "
           "(its heads), summed across them after the backward: its per-example gradients are summed first "
           "on the generic rule only, not on its own rule" if style == "replicated_with_grad_allreduce" else
           f"per-example norms are checked for {list(HF_STYLES)} only")
    raise ValueError(f"module {slot.name!r} ({type(slot.module).__name__}): transformers' tensor-parallel "
                     f"style {style!r}, for which per-example gradient norms are not supported: {why}. "
                     "Measure the model under data parallelism (FSDP2 or DDP), or give that module another "
                     "style")


def data_parallel_group(layouts):
    """The processes whose examples differ when the model has tensor-parallel layers (``layouts``: theirs,
    from :func:`tensor_parallel`): those at this process's place along every mesh dimension a layer is split
    along (a ``('dp', 'tp')`` mesh's ``mesh['dp']`` group; under transformers' ``DistributedConfig``, its
    ``dp_replicate_size × fsdp_size`` processes). Collective: every process forms every group."""
    place = sorted({(str(mesh.mesh_dim_names or tuple(mesh.shape)), d, mesh.get_local_rank(d))
                    for tp in layouts for mesh, dims, _, _ in tp.values() for d in dims})
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    groups: dict[str, list[int]] = {}
    for rank, p in enumerate(places):
        groups.setdefault(repr(p), []).append(rank)
    mine, _ = dist.new_subgroups_by_enumeration(sorted(groups.values()))
    return mine


def tensor_parallel(model, slot) -> dict:
    """{parameter: (mesh, the mesh dimensions it is sharded along, rows, cut)} in its forward, for ``slot``'s
    module if it is one of :data:`TP_LAYERS` whose needed parameters are DTensors there
    (``parallelize_module``'s ColwiseParallel or RowwiseParallel, transformers' own styles, FSDP2 around it
    or not); else {}. ``rows``: the (first, end) rows of a vocabulary-split embedding table (RowwiseParallel:
    Shard(0)) this process holds, else None. ``cut``: (side, first, end, width): of the output's ("out") or
    the input's ("in") ``width`` features, those this process's weight shard meets, for a call that gathers
    them inside its forward (transformers' ``colwise_gather_output``: the hooks see the whole width;
    :func:`local_call`), else None.
    Under FSDP2, the layout FSDP2 unshards them to (its parameter records: a private API, looked up
    defensively; a layer it cannot read is refused by name when it runs)."""
    refuse_hf_style(model, slot)
    # (a tied slot's table, also where another member keeps its norm: gns.tied reads its layout)
    need = (*slot.need, "weight") if slot.tied and "weight" not in slot.need else slot.need
    params = {n: slot.module._parameters.get(n) for n in need}
    if not isinstance(slot.module, TP_LAYERS) or not any(isinstance(p, DTensor) for p in params.values()):
        return {}
    from torch.distributed.fsdp import FSDPModule
    m, unit = model, None
    for part in [None, *(slot.name.split(".") if slot.name else ())]:
        m = m if part is None else m._modules[part]
        unit = m if isinstance(m, FSDPModule) else unit          # the innermost FSDP2 unit holds them
    if unit is None:
        out = {n: (p.device_mesh, p.placements) for n, p in params.items() if isinstance(p, DTensor)}
    else:
        try:
            records = _records(unit)
            out = {}
            for n in params:
                fp = records[(id(slot.module), n)]
                if not fp.is_dtensor:             # FSDP2's alone: whole in the forward
                    return {}
                spec = fp._unsharded_dtensor_spec
                out[n] = (spec.mesh, spec.placements)
        except (AttributeError, KeyError):       # (another FSDP2 version's records)
            return {}
    layout = {}
    for n, (mesh, placements) in out.items():
        dims = tuple(d for d, q in enumerate(placements) if not q.is_replicate())
        rows = [d for d in dims if isinstance(slot.module, torch.nn.Embedding) and placements[d].is_shard(0)]
        if len(rows) > 1 or (rows and len(dims) > 1):
            return {}                             # (a table split along more than one mesh dimension)
        cut = None
        if n == "weight" and len(dims) == 1 and not rows and placements[dims[0]].is_shard():
            tdim = placements[dims[0]].dim % 2                 # (weight: Linear (out, in), Embedding (V, D))
            linear = isinstance(slot.module, torch.nn.Linear)
            side = "in" if linear and tdim == 1 else "out"
            width = tuple(slot.module.weight.shape)[tdim]
            cut = (side, *_rows(width, mesh, dims[0]), width)
        layout[n] = (mesh, dims, _rows(slot.module.num_embeddings, mesh, rows[0]) if rows else None, cut)
    if slot.tied and "weight" in layout and len(layout["weight"][1]) != 1:
        raise ValueError(f"module {slot.name!r}: its table is tied to another module's weight (gns.tied) and "
                         "split by tensor parallelism along more than one mesh dimension, for which "
                         "per-example gradient norms are not supported; split it along one (the vocabulary "
                         "or the embedding width), untie it (transformers: tie_word_embeddings=False), or "
                         "measure the model under data parallelism")
    return layout


def _rows(n: int, mesh, dim: int) -> tuple[int, int]:
    """The rows of an ``n``-row table this process holds when it is split along mesh dimension ``dim`` (as
    Shard(0) splits a tensor: chunks of ⌈n / size⌉, the last ones shorter or empty)."""
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    chunk = -(-n // size)
    first = min(rank * chunk, n)
    return first, min(first + chunk, n)


def local_call(slot, saved: tuple, g):
    """This process's part of a tensor-parallel call (for :func:`elasticlab.gns.hooks.on_grad`): its shards
    of the kept inputs and of the output gradient; for a vocabulary-split embedding, the output gradient at
    the positions whose index is in this process's rows of the table only (each index's rows are held by
    one process: the sum over them, :func:`reduce_norms`, counts each once)."""
    saved = tuple(local(t) if isinstance(t, torch.Tensor) else t for t in saved)
    g = local(g)
    _, _, rows, cut = slot.tp.get("weight", (None, (), None, None))
    if rows is not None:
        idx = saved[0]
        g = g * ((idx >= rows[0]) & (idx < rows[1])).unsqueeze(-1).to(g.dtype)
    if cut is not None:                       # a width gathered in the forward: this shard's features only
        side, first, end, whole = cut
        if side == "out" and g.shape[-1] == whole != end - first:
            g = g[..., first:end]
        elif side == "in" and saved and saved[0].shape[-1] == whole != end - first:
            saved = (saved[0][..., first:end], *saved[1:])
    return saved, g


def reduce_norms(slots) -> None:
    """The per-example norms of the tensor-parallel layers' parameters (each from this process's shard of
    the layer's input and output gradient: ``local`` of them, in :func:`elasticlab.gns.hooks.on_grad`), made
    those of the whole parameters once per backward: summed over the mesh dimensions the parameter is
    sharded along in the forward (a Shard(0) weight of ColwiseParallel, Shard(1) of RowwiseParallel, the
    former's bias), not over those it is replicated along (RowwiseParallel's bias). One all-reduce per mesh
    dimension."""
    groups: dict[tuple, tuple] = {}
    for s in slots:
        if s.tp and s.tp_pending:
            s.tp_pending = False
            for pn in s.norms:
                mesh, dims, _, _ = s.tp.get(pn, (None, (), None, None))
                if dims:
                    groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append((s, pn))
    for mesh, dims, where in groups.values():
        t = torch.stack([s.norms[pn] for s, pn in where])
        for d in dims:
            dist.all_reduce(t, group=mesh.get_group(d))
        for (s, pn), v in zip(where, t):
            s.norms[pn] = v


def is_sharded(params) -> bool:
    """Whether any of ``params`` is a DTensor (FSDP2)."""
    return any(isinstance(p, DTensor) for p in params)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of ``t`` (``t`` itself when it is not a DTensor); a partial DTensor (whose
    values are the sum of the shards, not their union) is summed first."""
    if not isinstance(t, DTensor):
        return t
    if any(p.is_partial() for p in t.placements):
        return t.full_tensor()
    return t.to_local()


def _shard_dims(t) -> tuple[int, ...]:
    if not isinstance(t, DTensor) or any(p.is_partial() for p in t.placements):
        return ()                                         # (partial: made whole by local())
    # not replicated: Shard, and _StridedShard (FSDP2's dimension around tensor parallelism)
    return tuple(d for d, p in enumerate(t.placements) if not p.is_replicate())


def shard_groups(grads: list[torch.Tensor]) -> list[tuple]:
    """(mesh, mesh dimensions, indices) of the sharded ``grads``, those split along the same dimensions of
    one mesh together: what :func:`reduce_sq` reduces (kept without the gradients themselves)."""
    groups: dict[tuple, tuple] = {}
    for i, g in enumerate(grads):
        dims = _shard_dims(g)
        if dims:
            groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(i)
    return list(groups.values())


def reduce_sq(vals: list[torch.Tensor], groups: list[tuple]) -> list[torch.Tensor]:
    """``vals[i]``, Σ g² of ``local(grads[i])`` (0-dim), made Σ g² of the whole ``grads[i]``, given
    ``shard_groups(grads)``: one all-reduce per mesh dimension the sharded ones are split along, all of them
    together. Every process must call it with the same gradients (as FSDP2's are)."""
    out = list(vals)
    for mesh, dims, idx in groups:
        t = torch.stack([vals[i] for i in idx])
        for d in dims:
            dist.all_reduce(t, group=mesh.get_group(d))
        for k, i in enumerate(idx):
            out[i] = t[k]
    return out
