"""A fully sharded replica: the model built on the meta device, cut into blocks, each block's parameters split
over the process group with PyTorch's ``fully_shard`` (FSDP2), and only this rank's shards ever allocated.

Fully sharded data parallelism is ZeRO stage 3 (Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020) as PyTorch implements it (Zhao et al.,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023): every rank holds 1/N of
each parameter (dim 0, ``torch.chunk`` order), of its gradient and of its optimizer state; a block's full
parameters are all-gathered just before it computes, forward and backward, and freed after; its gradient is
reduce-scattered as backward leaves it.

Initial values: the model's modules are initialised by their own ``reset_parameters()``, one module at a
time, in ``model.modules()`` order under the run's seed: each module's parameters exist in full only while
it initialises, then this rank keeps its chunk.  That is the order in which a factory of standard layers
draws its random numbers, so the shards are the same numbers the other modes' replicas start from.  Where
that order or those methods cannot be trusted (:func:`meta_init_refusal`: a module without
``reset_parameters()``, one holding parameters of its own and in its children, buffers a module outside
``torch.nn`` makes, parameters shared by two modules), or the factory cannot run on the meta device, the
whole model is built in memory once and sharded.  Initialisation a factory does outside its modules'
``reset_parameters()`` (``self.apply(init_fn)`` in ``__init__``) is not seen on the meta device.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from sparkdl._internal.memory import require_address_space
from sparkdl._internal.training.pipeline_cuts import whole_model
from sparkdl.config import TrainConfig

log = logging.getLogger(__name__)

#: containers whose members are the model's repeated layers: the automatic blocks
_BLOCK_CONTAINERS = (nn.Sequential, nn.ModuleList)


def shard_blocks(model: nn.Module, block_classes: str | None) -> list[nn.Module]:
    """The modules sharded as one block each, outermost first (the root is sharded last, holding the rest).

    ``block_classes`` names them by class (comma-separated); None picks every module held directly in an
    ``nn.Sequential`` or ``nn.ModuleList`` that has parameters: a transformer's blocks, an MLP's layers.  A
    block inside another block is not one of its own.
    """
    names = {n.strip() for n in block_classes.split(",") if n.strip()} if block_classes else None
    if names is not None:
        found = {type(m).__name__ for m in model.modules()}
        if missing := sorted(names - found):
            raise ValueError(f"shard_blocks names {missing}, which the model does not use; its module classes are "
                             f"{sorted(found)}")
    blocks: list[nn.Module] = []
    tied = _tied_parameters(model)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if names is not None:
                chosen = type(child).__name__ in names
            else:
                chosen = isinstance(module, _BLOCK_CONTAINERS) and not isinstance(child, _BLOCK_CONTAINERS)
            # a parameter shared with a module outside the block must stay in one group: the root's
            holds_tied = any(id(p) in tied for p in child.parameters())
            if chosen and any(True for _ in child.parameters()) and not holds_tied:
                blocks.append(child)
            else:
                visit(child)

    visit(model)
    return blocks


def build_sharded(model_fn: Any, config: TrainConfig, mesh: Any, device: torch.device) -> nn.Module:
    """This rank's replica of ``model_fn()``'s model, sharded (:func:`shard_model`), holding this rank's shards of
    the initial weights (the same values every mode starts from)."""
    meta: nn.Module | None = None
    try:
        with torch.device("meta"):
            meta = whole_model(model_fn)
    except Exception as exc:   # e.g. a factory that loads weights from a file
        log.warning("sparkdl: the model factory cannot run on the meta device (%s); each fsdp worker builds the "
                    "whole model once, then shards it", exc)
    if meta is not None and (refusal := meta_init_refusal(meta)) is None:
        return shard_model(meta, mesh, device, config.precision, config.shard_blocks, config.seed)
    if meta is not None:
        log.warning("sparkdl: fsdp cannot initialise this model shard by shard on the meta device (%s); each fsdp "
                    "worker builds the whole model once, then shards it", refusal)
        require_address_space(4 * sum(p.numel() for p in meta.parameters()),   # its float32 parameters
                              "the whole model, built once before it is sharded,",
                              "Give every module with parameters a reset_parameters() (then each worker "
                              "allocates its shards only), or give the Python workers more memory")
    torch.manual_seed(config.seed)
    return shard_model(whole_model(model_fn), mesh, device, config.precision, config.shard_blocks, config.seed)


def shard_model(model: nn.Module, mesh: Any, device: torch.device, precision: str = "32",
                block_classes: str | None = None, seed: int = 0) -> nn.Module:
    """``model`` with its blocks (:func:`shard_blocks`) and root wrapped by ``fully_shard`` over ``mesh``, in
    ``precision``'s mixed precision; its parameters become this rank's shards (on ``mesh``'s device).

    A model on the meta device is materialised here: its modules' ``reset_parameters()`` run under ``seed``,
    one module at a time in full, and this rank keeps its chunk of each parameter.
    """
    from torch.distributed.fsdp import fully_shard

    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if on_meta and (refusal := meta_init_refusal(model)) is not None:
        raise ValueError(f"a model on the meta device is initialised by its modules' reset_parameters(), and this "
                         f"one cannot be: {refusal}; build it on the CPU instead")
    policy = mixed_precision(precision)
    for block in shard_blocks(model, block_classes):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    # the root's output (the model's) in float32, so the loss is computed in float32
    fully_shard(model, mesh=mesh, mp_policy=dataclasses.replace(policy, output_dtype=torch.float32)
                if policy.param_dtype is not None else policy)
    if not on_meta:
        return model.to(device)   # the shards are on the mesh's device already; the buffers follow
    model.to_empty(device=device)
    rank, world = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if _holds_state(module):
                _initialise(module, rank, world)
    return model


def mixed_precision(precision: str) -> Any:
    """FSDP's mixed precision for the run's ``precision``: under "bf16-mixed" bf16 parameters for compute and
    all-gather, float32 gradient reduction and master weights; otherwise float32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16-mixed":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def meta_init_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s modules' ``reset_parameters()`` cannot reproduce its factory's initial values, one module
    at a time in ``model.modules()`` order (None: they can)."""
    lacking = sorted({type(m).__name__ for m in model.modules() if _holds_state(m) and not hasattr(m, "reset_parameters")})
    if lacking:
        return f"{lacking} hold parameters or buffers and have no reset_parameters()"
    if _tied_parameters(model):
        return "some parameters are shared by two modules (tied weights)"
    for name, module in model.named_modules():
        if _holds_state(module) and any(_holds_state(m) for m in module.modules() if m is not module):
            return (f"{name or 'the model'} ({type(module).__name__}) holds parameters or buffers of its own and in its "
                    "children, so the order it draws them in is unknown")
        if any(True for _ in module.buffers(recurse=False)) and not type(module).__module__.startswith("torch.nn"):
            return f"{type(module).__name__} makes buffers, which reset_parameters() may leave unset"
    return None


def scalar_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s 0-dim parameters, which fully_shard cannot split."""
    return [name for name, p in model.named_parameters() if p.dim() == 0]


def _tied_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters that two or more modules hold."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _initialise(module: nn.Module, rank: int, world: int) -> None:
    """``module.reset_parameters()`` on full-size parameters, of which this rank keeps its chunk."""
    sharded = dict(module.named_parameters(recurse=False))
    full = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            for name, p in sharded.items()}
    try:
        for name, tensor in full.items():
            module._parameters[name] = tensor
        module.reset_parameters()   # type: ignore[operator]
    finally:
        for name, p in sharded.items():
            module._parameters[name] = p
    for name, p in sharded.items():
        local = p.to_local() if hasattr(p, "to_local") else p
        chunks = full[name].detach().chunk(world, dim=0)
        if local.numel():
            local.copy_(chunks[rank].reshape(local.shape))


def local_state(model: nn.Module, with_buffers: bool) -> dict[str, torch.Tensor]:
    """This rank's chunk of every parameter (CPU), and with ``with_buffers`` the model's buffers, by state-dict name."""
    state = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
             for name, p in model.named_parameters(remove_duplicate=False)}   # tied: under each name
    if with_buffers:
        keys = set(model.state_dict(keep_vars=True))
        state.update({name: b.detach().cpu() for name, b in model.named_buffers() if name in keys})
    return state


def encode_state(state: dict[str, torch.Tensor]) -> str:
    """Tensors as base64 text (a task's summary travels as JSON)."""
    buffer = io.BytesIO()
    torch.save({k: v.contiguous() for k, v in state.items()}, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_state(text: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    return state


def assemble_state(keys: Iterator[str], shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state dict from the ranks' local states (in rank order): parameters concatenated on dim 0,
    buffers from rank 0, in ``keys`` order."""
    state = {}
    for key in keys:
        pieces = [shard[key] for shard in shards if key in shard]
        state[key] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    return state
