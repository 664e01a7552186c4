"""The registry of per-layer rules for per-example gradient norms, keyed by module type (Opacus' shape).

Each layer family lives in its own module of :mod:`elasticlab.gns.layers` and registers its rule there with
:func:`register_rule`. A rule's ``norms(module, inputs, grad_output, need)`` returns {param name: (B,) squared
norms} of the per-example gradients *of the loss as reduced* (no B² rescaling; the caller applies it), from
the layer's inputs and the gradient of its output, for the direct parameters named in ``need``. Its
``params`` names the direct parameters it covers: a tuple of names, or a callable ``params(module)`` giving
them for one module instance (the recurrent layers', which depend on ``num_layers``), read through
:func:`covered_params`. Its optional ``fused(module, slot)`` returns a replacement forward whose backward
forms the parameter gradients and the norms in one pass, or None when that configuration is not supported.
Its optional ``check(module)`` runs at every call with gradients on and raises a ValueError when
per-example gradients are not defined in the module's current state (BatchNorm in training mode).
Its optional ``summed(module, calls, need)`` gives the norms of the gradient summed over several calls of one
module in a forward, ``calls`` a list of (inputs, output gradient) (:mod:`elasticlab.gns.repeated`; without it
a hook rule's calls are summed by torch.func). ``calls_children``: the fused forward calls child modules whose
parameters the module's own forward uses directly (``nn.MultiheadAttention``'s ``out_proj``), so it is
installed whenever any parameter below the module trains, even with none of its own trainable.
``sums_calls``: the fused form adds up a step's calls itself (:mod:`.layers.broadcast_params`).
``unbatched`` (hook rules): a call on an input without the batch (dim 0 not the model's batch: a positional
embedding on ``position_ids`` (1, T)) is followed to where its output is broadcast over the batch
(:mod:`.layers.broadcast_params`) instead of read by the rule. ``kwargs`` (hook rules): its ``inputs`` end
with the call's keyword arguments as a dict, where there are any (:mod:`elasticlab.gns.hooks`). ``folds``: the
layer is row-wise, so a call on the examples folded with their positions into dim 0 ((B·T, D), OPT) is read
unfolded to (B, T, …) (:mod:`elasticlab.gns.folds`). ``on_owner``: the module holds the originals of a
parametrized tensor (a ``ParametrizationList``), and its rule runs on the calls of the layer that owns it,
with ``need`` named from that layer (:mod:`.layers.parametrized`). ``rows`` (hook rules): a call on rows that
fold the batch is handed to ``norms`` as is, with ``fold=`` its layout, for the rule to read each example's
rows together (the generic rule, which checks that they are row-wise: a mixture of experts' router on
(B·T, D)). ``outputs`` (hook rules): a call whose output is a tuple of tensors (a router's logits, weights
and indices) gets ``grad_output`` as a tuple, None where an output carries no gradient and zeros where the
loss did not reach it. ``reruns`` (hook rules): ``norms`` runs the module's forward again (the generic rule),
so it runs under the autocast state of the call's forward, as :func:`~.layers.common.forward_autocast` kept
it (in the backward, autocast is off or whatever the caller set).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class Rule:
    norms: Callable | None
    params: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ("weight", "bias")
    fused: Callable | None = None
    check: Callable | None = None
    calls_children: bool = False
    summed: Callable | None = None
    sums_calls: bool = False
    unbatched: bool = False
    kwargs: bool = False
    folds: bool = False
    on_owner: bool = False
    rows: bool = False
    outputs: bool = False
    reruns: bool = False


RULES: dict[type, Rule] = {}


def register_rule(module_type: type, norms: Callable, *, params=("weight", "bias"), fused=None,
                  check=None, calls_children: bool = False, summed=None, unbatched: bool = False,
                  folds: bool = False) -> Rule:
    """Register (or replace) the rule for ``module_type``; returns it."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(f"register_rule: expected an nn.Module subclass, got {module_type!r}")
    if norms is None and fused is None:
        raise ValueError(f"register_rule: {module_type.__name__} needs a hook rule (norms), a fused form, "
                         "or both")
    if norms is not None and not callable(norms):
        raise ValueError(f"register_rule: norms must be callable or None, got {norms!r}")
    if calls_children and fused is None:
        raise ValueError(f"register_rule: {module_type.__name__}: calls_children needs a fused form")
    if not callable(params):
        names = tuple(params) if isinstance(params, (tuple, list)) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise ValueError(f"register_rule: {module_type.__name__}: params must be a tuple of parameter "
                             f"names or a callable params(module) giving them, got {params!r}")
        params = names
    if summed is not None and not callable(summed):
        raise ValueError(f"register_rule: {module_type.__name__}: summed must be callable or None, got "
                         f"{summed!r}")
    if unbatched and fused is not None:
        raise ValueError(f"register_rule: {module_type.__name__}: unbatched is for hook rules only")
    rule = Rule(norms=norms, params=params, fused=fused, check=check,
                calls_children=bool(calls_children), summed=summed, unbatched=bool(unbatched),
                folds=bool(folds))
    RULES[module_type] = rule
    return rule


FALLBACK: list[tuple[Rule, Callable[[nn.Module], bool]]] = []   # (rule, applies(module)), in order
BY_NAME: dict[tuple[str, str], tuple[Callable, dict]] = {}      # (module path, class) -> (norms, kwargs)


def register_rule_by_name(module_path: str, class_name: str, norms: Callable, **kwargs) -> None:
    """A rule for a class of a library elasticlab does not import (``transformers.pytorch_utils.Conv1D``),
    named by where it is defined: registered (:func:`register_rule`, ``kwargs`` its arguments) when
    :func:`rule_for` first meets the class, so that the library is never imported for it."""
    BY_NAME[(module_path, class_name)] = (norms, kwargs)


def register_fallback(rule: Rule, applies: Callable[[nn.Module], bool]) -> Rule:
    """A rule for modules of no registered type (or a subclass with a forward of its own) for which
    ``applies(module)`` holds (:mod:`elasticlab.gns.layers.generic`: leaf modules, by torch.func)."""
    FALLBACK.append((rule, applies))
    return rule


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of the nearest registered base class whose ``forward`` the module still uses, else the
    first fallback that applies to it."""
    for cls in type(module).__mro__:
        rule = RULES.get(cls)
        if rule is None and BY_NAME and (named := BY_NAME.pop((cls.__module__, cls.__qualname__), None)):
            rule = register_rule(cls, named[0], **named[1])
        if rule is not None:
            if type(module).forward is cls.forward:
                return rule
            break
    return next((rule for rule, applies in FALLBACK if applies(module)), None)


def covered_params(rule: Rule, module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s direct parameters that ``rule`` covers (its ``params``, called on the module
    when it is a callable)."""
    return tuple(rule.params(module)) if callable(rule.params) else rule.params


def uncovered(name: str, module: nn.Module, params: list[str]) -> str:
    """Why ``module``'s trainable ``params`` (full names) have no per-example norms, and the ways out."""
    owner = name.rsplit(".parametrizations.", 1)
    if isinstance(module, parametrize.ParametrizationList) and len(owner) == 2:
        what = (f"{params} are the originals of a parametrization of {owner[0] or '(root)'!r}'s "
                f"{owner[1]!r} (weight_norm, spectral_norm, torch.nn.utils.parametrize): a layer's rule sees "
                "the per-example gradients of the tensor they make, not theirs, and no rule maps them back")
    else:
        what = (f"no per-example gradient-norm rule for module {name or '(root)'!r} of type "
                f"{type(module).__name__} (parameters {params})")
    return (f"{what}; register one with elasticlab.gns.register_rule, freeze them, or pass strict=False to "
            "leave them out")
