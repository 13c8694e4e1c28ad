"""Embedding tables whose rows live on the parameter server: the module a worker's replica uses instead.

A table is an ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True``: the flag
PyTorch users already set to get row-sparse gradients is the declaration, so a model needs no
other change.  :func:`swap_tables` replaces each such module by a :class:`RemoteEmbedding`
that holds no rows.  Its ``forward`` looks the batch's ids up on demand: it pulls the rows of
the distinct ids from a :class:`RowSource` (the parameter server), computes the embedding from
those rows only, and after ``backward`` hands their gradients back as :class:`TouchedRows`.
The rows are fetched where the ids are known, inside the model, rather than from a declared
mapping of input columns to tables: models hash, offset or combine ids before the lookup
(several fields sharing one table, ``EmbeddingBag`` offsets), and only the module sees the
ids it will use.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from sparkdl._internal.ps.tables import TableSpec, coalesce_rows, row_optimizer
from sparkdl._internal.ps.worker.table_prefetch import TablePrefetch, distinct_ids
from sparkdl.config import TrainConfig
from sparkdl.errors import DataError

TABLE_MODULES = (nn.Embedding, nn.EmbeddingBag)


class RowSource(Protocol):
    """Where a table's rows come from: the parameter server, or the tables themselves in one process."""

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The current rows ``ids`` (distinct, int64) of ``table``: float32 ``[len(ids), dim]``."""
        ...

    def pull_tables(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The current rows of each (table, distinct int64 ids), in one request."""
        ...


@dataclass(frozen=True)
class TouchedRows:
    """One table's gradient after ``backward``: its distinct row ids (sorted) and their summed gradients."""

    ids: torch.Tensor
    grads: torch.Tensor


def sparse_tables(model: nn.Module) -> Iterator[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """The model's tables: its ``nn.Embedding``/``nn.EmbeddingBag`` modules built with ``sparse=True``.

    A ValueError for one the parameter server cannot hold as rows: a subclass with a ``forward`` of its
    own (the stand-in only looks rows up), a frozen one, or one whose weight another module shares
    (tied weights would be both rows and part of the dense vector).
    """
    shared: dict[int, list[str]] = {}
    for parameter_name, parameter in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(parameter), []).append(parameter_name)
    for name, module in model.named_modules():
        if not (isinstance(module, TABLE_MODULES) and module.sparse):
            continue
        base = next(cls for cls in TABLE_MODULES if isinstance(module, cls))
        if type(module).forward is not base.forward:
            raise ValueError(f"table {name!r}: {type(module).__name__} has a forward of its own, and a table held "
                             "by the parameter server is only looked up row by row; build it without sparse=True "
                             "or move the extra computation into the parent module")
        if not module.weight.requires_grad:
            raise ValueError(f"table {name!r} is frozen (requires_grad=False): build it without sparse=True")
        if len(shared.get(id(module.weight), ())) > 1:
            raise ValueError(f"table {name!r}: its weight is shared with {shared[id(module.weight)]} (tied "
                             "weights), which a table held as rows cannot be; build it without sparse=True")
        yield name, module


def table_spec(name: str, module: nn.Embedding | nn.EmbeddingBag, optimizer: str, seed: int) -> TableSpec:
    """The PS's description of the table ``module`` (a ValueError for options a PS-held table cannot keep)."""
    if module.max_norm is not None:
        raise ValueError(f"table {name!r}: max_norm renormalises rows in place during forward, which a table "
                         "held by the parameter server cannot do; drop max_norm or sparse=True")
    return TableSpec(name=name, rows=module.num_embeddings, dim=module.embedding_dim, optimizer=optimizer, seed=seed,
                     padding_idx=module.padding_idx)


def _rowless_when_sparse(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` of a table module that, given ``sparse=True`` and no device, builds the weight on the meta device."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def build(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("sparse") and bound.arguments.get("device") is None:
            bound.arguments["device"] = "meta"
        init(*bound.args, **bound.kwargs)
    return build


@contextlib.contextmanager
def tables_without_rows() -> Iterator[None]:
    """While open, ``nn.Embedding``/``nn.EmbeddingBag`` modules built with ``sparse=True`` allocate no rows
    (their weight is on the meta device; ``nn.init`` calls on it do nothing).  A worker builds its replica
    so: :func:`swap_tables` replaces the tables, and their rows live on the parameter server, so a replica
    never holds a whole table."""
    originals = {cls: cls.__init__ for cls in TABLE_MODULES}
    try:
        for cls, init in originals.items():
            cls.__init__ = _rowless_when_sparse(init)  # type: ignore[method-assign]
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init  # type: ignore[method-assign]


def table_specs(model: nn.Module, config: TrainConfig) -> tuple[TableSpec, ...]:
    """The PS's descriptions of ``model``'s tables, in module order (the order their indices follow)."""
    return tuple(table_spec(name, module, row_optimizer(config), config.seed) for name, module in sparse_tables(model))


class RemoteEmbedding(nn.Module):
    """Stands in for one table: the same ``forward`` as the module it replaces, computed from pulled rows."""

    def __init__(self, name: str, module: nn.Embedding | nn.EmbeddingBag, source: RowSource) -> None:
        super().__init__()
        table_spec(name, module, "sgd", 0)   # refuses what a PS-held table cannot do
        self.name = name
        self.source = source
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.padding_idx = module.padding_idx
        self.scale_grad_by_freq = module.scale_grad_by_freq
        self.bag = isinstance(module, nn.EmbeddingBag)
        self.mode = module.mode if isinstance(module, nn.EmbeddingBag) else ""
        self.include_last_offset = module.include_last_offset if isinstance(module, nn.EmbeddingBag) else False
        #: (distinct ids, their pulled rows) of every forward with gradients since the last take_touched
        self._pulled: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the replica's pulls ahead of the model's call (see :func:`prefetch_tables`), or None: each lookup pulls
        self.prefetch: TablePrefetch | None = None

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.num_embeddings}, {self.embedding_dim}, held by the parameter server"

    def check_ids(self, ids: torch.Tensor) -> None:
        """A DataError for ids that are not integers in ``[0, num_embeddings)``."""
        self.check_dtype(ids)
        self.check_range(ids)

    def check_dtype(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise DataError(f"table {self.name!r} takes int64 or int32 ids, not {ids.dtype}; give the column as "
                            "integers (typed inputs keep them as int64)")

    def check_range(self, ids: torch.Tensor) -> None:
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            position = tuple(int(i) for i in bad.nonzero()[0])
            raise DataError(f"table {self.name!r} has {self.num_embeddings} rows, but the batch holds id "
                            f"{int(ids[bad][0])} at position {position}: ids must lie in "
                            f"[0, {self.num_embeddings}); nothing was pulled or updated")

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        pulled = self.prefetch.take(self, input) if self.prefetch is not None else None
        if pulled is None:
            lookup = distinct_ids([(self, input)])[0]
            assert lookup is not None   # invalid ids raised
            ids, local = lookup
            values = self.source.pull_rows(self.name, ids)
            if self.prefetch is not None:
                self.prefetch.learn(self, input)
        else:   # pulled before the model's call, with the other tables' rows
            ids, local, values = pulled
        rows = values.to(device=input.device, dtype=torch.float32)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pulled.append((ids, rows))
        padding = None
        if self.padding_idx is not None:
            found = (ids == self.padding_idx).nonzero()
            padding = int(found[0, 0]) if found.numel() else None
        if not self.bag:
            return F.embedding(local, rows, padding_idx=padding, scale_grad_by_freq=self.scale_grad_by_freq)
        return F.embedding_bag(local, rows, offsets, scale_grad_by_freq=self.scale_grad_by_freq, mode=self.mode,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset,
                               padding_idx=padding)

    def take_touched(self) -> TouchedRows | None:
        """The gradients of the rows pulled since the last call (None when no ``backward`` reached them);
        forgets those rows."""
        pulled, self._pulled = self._pulled, []
        # the ids are on the host (distinct_ids); the gradients join them there
        reached = [(ids.cpu(), rows.grad.cpu()) for ids, rows in pulled if rows.grad is not None]
        if not reached:
            return None
        if len(reached) == 1:    # one lookup (the usual case): its ids are distinct already
            ids, grads = reached[0]
        else:
            ids, grads = coalesce_rows(torch.cat([ids for ids, _ in reached]), torch.cat([g for _, g in reached]))
        return TouchedRows(ids, grads)


def swap_tables(model: nn.Module, source: RowSource) -> dict[str, RemoteEmbedding]:
    """Replace each of ``model``'s tables by a :class:`RemoteEmbedding` pulling from ``source``, in place."""
    swapped: dict[str, RemoteEmbedding] = {}
    for name, module in list(sparse_tables(model)):
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not parent_name and not attribute:
            raise ValueError("the model itself is a table: wrap it in a module that holds it")
        remote = RemoteEmbedding(name, module, source)
        setattr(parent, attribute, remote)
        swapped[name] = remote
    return swapped


def prefetch_tables(model: nn.Module, tables: dict[str, RemoteEmbedding], source: RowSource) -> TablePrefetch | None:
    """Let ``model``'s tables whose ids are inputs of its call be pulled together before it runs (one round
    trip per call for all of them, see :mod:`~sparkdl._internal.ps.worker.table_prefetch`); None without tables."""
    if not tables:
        return None
    prefetch = TablePrefetch(source)
    for table in tables.values():
        table.prefetch = prefetch
    prefetch.install(model)
    return prefetch


class _DriverSide:
    """The source of the driver's template: its tables are on the parameter server, and it never runs forward."""

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"table {table!r} is held by the parameter server; the driver's template does not run")

    def pull_tables(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        raise RuntimeError("the tables are held by the parameter server; the driver's template does not run")


def detach_tables(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    """Take ``model``'s tables out (its parameters are then the dense ones the flat vector holds); returns them,
    to be put back by :func:`attach_tables`."""
    originals = dict(sparse_tables(model))
    swap_tables(model, _DriverSide())
    return originals


def attach_tables(model: nn.Module, originals: dict[str, nn.Embedding | nn.EmbeddingBag],
                  weights: dict[str, torch.Tensor]) -> None:
    """Put the tables :func:`detach_tables` took out back into ``model``, holding ``weights``."""
    for name, module in originals.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            module.weight.copy_(weights[name])
        setattr(parent, attribute, module)
