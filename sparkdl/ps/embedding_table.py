"""An embedding table as the parameter server holds it: rows, a row-wise optimizer, seeded lazy initialisation.

A table (an ``nn.Embedding`` or ``nn.EmbeddingBag`` declared ``sparse=True``) is not part of
the flat parameter vector: the PS keeps it as rows, workers pull the rows a batch touches and
push those rows' gradients (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014: push and pull of only the keys a worker touches).  With
``shards`` PS shards, row ``r`` lives on shard ``r % shards`` at local index ``r // shards``:
ids are often ranked by frequency (Zipf), so ranges would put the hot rows on one shard,
while a stride spreads them.

The optimizers update only the rows a gradient names, as PyTorch's sparse optimizers do:

* ``"sgd"``: ``w_r <- w_r - lr g_r`` (``torch.optim.SGD`` on a sparse gradient, no momentum).
* ``"adagrad"``: ``s_r <- s_r + g_r^2``, ``w_r <- w_r - lr g_r / (sqrt(s_r) + eps)``
  (``torch.optim.Adagrad``; Duchi, Hazan and Singer, JMLR 2011).
* ``"lazy_adam"``: Adam's moments of the touched rows only; untouched rows keep theirs, and the
  bias correction uses the table's step count (``torch.optim.SparseAdam``).

Momentum and weight decay are not applied to tables (the launcher warns when they are set): either
would change every row at every step (``torch.optim.Adagrad`` and ``SparseAdam`` refuse them on sparse
gradients too).  A table starts from the model's own rows; :func:`initial_rows` draws them the way
``nn.Embedding`` does for a table given no values.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..training.optim import ADAM_BETAS, ADAM_EPS

#: the row-wise optimizers a table can use
ROW_OPTIMIZERS = ("sgd", "adagrad", "lazy_adam")
#: torch.optim.Adagrad's default epsilon
ADAGRAD_EPS = 1e-10
#: rows drawn per generator: initial values depend on the seed and the row, not on the sharding
INIT_BLOCK_ROWS = 65_536
#: each row optimizer's state, a value per row value for each key
STATE_KEYS = {"sgd": (), "adagrad": ("state_sum",), "lazy_adam": ("exp_avg", "exp_avg_sq")}
#: every row optimizer's state keys
ROW_STATE_KEYS = tuple(key for keys in STATE_KEYS.values() for key in keys)
_STATE_ROWS = {optimizer: len(keys) for optimizer, keys in STATE_KEYS.items()}


def with_state_of(state: dict, optimizer: str) -> dict:
    """A table's saved ``state`` without the state of row optimizers other than ``optimizer`` (a run resumed
    with another ``embedding_optimizer`` starts that optimizer's state afresh, and sends no other)."""
    foreign = set(ROW_STATE_KEYS) - set(STATE_KEYS[optimizer])
    return {key: value for key, value in state.items() if key not in foreign}


def row_optimizer(config: TrainConfig) -> str:
    """The tables' optimizer: ``embedding_optimizer``, where ``"auto"`` follows ``optimizer`` (SGD for
    ``"sgd"``, lazy Adam for ``"adam"`` and ``"adamw"``, as ``torch.optim.SparseAdam`` pairs with Adam)."""
    if config.embedding_optimizer != "auto":
        return config.embedding_optimizer
    return "sgd" if config.optimizer == "sgd" else "lazy_adam"


def table_bytes(rows: int, dim: int, optimizer: str, shards: int = 1) -> int:
    """Bytes one PS shard needs for its rows of a ``rows x dim`` float32 table and their optimizer state."""
    if optimizer not in _STATE_ROWS:
        raise ValueError(f"the table optimizer must be one of {ROW_OPTIMIZERS}, not {optimizer!r}")
    local_rows = -(-rows // shards)
    return local_rows * dim * 4 * (1 + _STATE_ROWS[optimizer])


#: room in a shard's message beyond its weights and tables: the run log's delta, counts and settings
MESSAGE_SLACK_BYTES = 256 << 20


def shard_message_bytes(specs: Sequence[TableSpec], shards: int, dense_params: int = 0) -> int:
    """The most bytes one PS shard's message can take (its start state, a snapshot, its final state): its
    ``dense_params`` weights with up to two optimizer values and the best epoch's weights, its part of the
    tables ``specs`` with their optimizer state, the best epoch's rows and a row id per row, and the slack."""
    tables = sum(table_bytes(t.rows, t.dim, t.optimizer, shards) + table_bytes(t.rows, t.dim, "sgd", shards)
                 + 8 * -(-t.rows // shards) for t in specs)
    return 16 * dense_params + tables + MESSAGE_SLACK_BYTES


def rows_digest(rows: torch.Tensor) -> str:
    """A digest of ``rows``' float32 values: a shard that built its initial rows itself checks them by it (a
    CRC, 0.3 s per GB here, where a cryptographic hash takes 0.7-3.6 s: it tells rows drawn otherwise apart,
    no peer chooses them)."""
    values = rows.detach().to("cpu", torch.float32).contiguous()
    return f"{tuple(values.shape)}:{zlib.crc32(values.numpy().data):08x}"


def coalesce_rows(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids made unique (sorted), the values of repeated ids summed: what a sparse gradient's
    ``coalesce()`` does, for several workers' pushes into one update."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros((unique.numel(), values.shape[1]), dtype=values.dtype, device=values.device)
    summed.index_add_(0, inverse, values)
    return unique, summed


@dataclass(frozen=True)
class TableSpec:
    """What the PS needs to hold one table: its size, where its rows start, how it learns."""

    name: str            # the module's name in the model (``model.named_modules()``)
    rows: int
    dim: int
    optimizer: str = "adagrad"
    seed: int = 0
    #: the row ``nn.Embedding(padding_idx=...)`` keeps at zero (no gradient reaches it)
    padding_idx: int | None = None

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r} must have rows and columns, not {self.rows} x {self.dim}")
        if self.optimizer not in ROW_OPTIMIZERS:
            raise ValueError(f"table {self.name!r}: the optimizer must be one of {ROW_OPTIMIZERS}, "
                             f"not {self.optimizer!r}")


def initial_rows(spec: TableSpec, shard: int = 0, shards: int = 1) -> torch.Tensor:
    """The rows of ``spec`` that PS shard ``shard`` of ``shards`` holds, drawn as ``nn.Embedding`` does
    (standard normal), block by block from generators seeded by (seed, table name, block), so the whole
    table is the same however it is sharded and no shard ever holds more than its rows and one block."""
    local = torch.empty((len(range(shard, spec.rows, shards)), spec.dim), dtype=torch.float32)
    generator = torch.Generator()
    table_seed = (spec.seed * 1_000_003 + zlib.crc32(spec.name.encode())) * 1_000_033
    for start in range(0, spec.rows, INIT_BLOCK_ROWS):
        stop = min(spec.rows, start + INIT_BLOCK_ROWS)
        generator.manual_seed((table_seed + start // INIT_BLOCK_ROWS) % 2**63)
        block = torch.randn((stop - start, spec.dim), generator=generator)
        first = (shard - start) % shards          # offset of this shard's first row in the block
        local[(start + first) // shards:(start + first) // shards + len(range(first, stop - start, shards))] = \
            block[first::shards]
    if spec.padding_idx is not None and spec.padding_idx % shards == shard:
        local[spec.padding_idx // shards] = 0.0
    return local


class EmbeddingTable:
    """One PS shard's rows of one table, with their row-wise optimizer state.

    Ids are global row ids; :meth:`gather` and :meth:`apply` check that every id belongs to
    this shard and the table before reading or writing anything.
    """

    def __init__(self, spec: TableSpec, shard: int = 0, shards: int = 1, learning_rate: float = 0.01,
                 rows: torch.Tensor | None = None) -> None:
        """``rows``: this shard's rows when known (a checkpoint), else :func:`initial_rows`."""
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not one of {shards}")
        self.spec = spec
        self.shard, self.shards = shard, shards
        self.learning_rate = learning_rate
        self.weight = initial_rows(spec, shard, shards) if rows is None else rows.to(torch.float32).contiguous()
        if self.weight.shape != (len(range(shard, spec.rows, shards)), spec.dim):
            raise ValueError(f"table {spec.name!r}: shard {shard} of {shards} holds "
                             f"{len(range(shard, spec.rows, shards))} rows of {spec.dim}, "
                             f"not {tuple(self.weight.shape)}")
        #: updates applied to this table (SparseAdam's step: its bias correction)
        self.steps = 0
        #: per local row: the update (``steps``) that last changed it, 0 when none did since the rows were
        #: loaded; what :meth:`changes_since` reads, so a shard's snapshot carries only its changed rows
        self.changed_at = torch.zeros(len(self.weight), dtype=torch.int32)
        self.state_sum: torch.Tensor | None = None     # adagrad
        self.exp_avg: torch.Tensor | None = None       # lazy_adam
        self.exp_avg_sq: torch.Tensor | None = None

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """This shard's row indices of the global ``ids``; a ValueError naming the first id that is outside
        the table or on another shard."""
        ids = ids.to(torch.int64)
        bad = (ids < 0) | (ids >= self.spec.rows) | (ids % self.shards != self.shard)
        if bool(bad.any()):
            first = int(ids[bad][0])
            where = ("outside the table" if not 0 <= first < self.spec.rows
                     else f"held by shard {first % self.shards}, not {self.shard}")
            raise ValueError(f"table {self.spec.name!r} ({self.spec.rows} rows): id {first} is {where}")
        return ids // self.shards

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the rows ``ids``, in their order."""
        return self.weight.index_select(0, self.local_index(ids))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, grad_scale: float = 1.0,
              learning_rate: float | None = None) -> None:
        """One update of the rows ``ids`` with ``grads / grad_scale``; repeated ids are summed first (one
        coalesced sparse gradient, as several workers' pushes into one sync update)."""
        index = self.local_index(ids)    # checked before anything is written
        if grads.shape != (ids.numel(), self.spec.dim):
            raise ValueError(f"table {self.spec.name!r}: {ids.numel()} ids need gradients of "
                             f"{(ids.numel(), self.spec.dim)}, not {tuple(grads.shape)}")
        lr = self.learning_rate if learning_rate is None else learning_rate
        self.steps += 1
        self.changed_at[index] = self.steps
        kind = self.spec.optimizer
        if kind == "sgd":    # linear in the gradient: repeated ids add up without coalescing
            self.weight.index_add_(0, index, grads.to(torch.float32), alpha=-lr / grad_scale)
            return
        index, grad = coalesce_rows(index, grads.to(torch.float32))
        if grad_scale != 1.0:
            grad = grad / grad_scale
        if kind == "adagrad":
            if self.state_sum is None:
                self.state_sum = torch.zeros_like(self.weight)
            self.state_sum.index_add_(0, index, grad * grad)
            std = self.state_sum.index_select(0, index).sqrt_().add_(ADAGRAD_EPS)
            self.weight.index_add_(0, index, grad / std, alpha=-lr)
        else:
            self._lazy_adam(index, grad, lr)

    def _lazy_adam(self, index: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        """``torch.optim.SparseAdam``'s step, in its order of operations."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.weight), torch.zeros_like(self.weight)
        if index.numel() == 0:
            return
        beta1, beta2 = ADAM_BETAS
        old_avg = self.exp_avg.index_select(0, index)
        avg_update = (grad - old_avg).mul_(1 - beta1)
        self.exp_avg.index_add_(0, index, avg_update)
        old_avg_sq = self.exp_avg_sq.index_select(0, index)
        avg_sq_update = (grad * grad - old_avg_sq).mul_(1 - beta2)
        self.exp_avg_sq.index_add_(0, index, avg_sq_update)
        numer = avg_update.add_(old_avg)
        denom = avg_sq_update.add_(old_avg_sq).sqrt_().add_(ADAM_EPS)
        step_size = lr * math.sqrt(1 - beta2 ** self.steps) / (1 - beta1 ** self.steps)
        self.weight.index_add_(0, index, numer.div_(denom), alpha=-step_size)

    def state_dict(self) -> dict:
        """The rows and their optimizer state (for checkpoints)."""
        state = {"weight": self.weight.clone(), "steps": self.steps}
        for key in ROW_STATE_KEYS:
            value = getattr(self, key)
            if value is not None:
                state[key] = value.clone()
        return state

    def changes_since(self, steps: int, optimizer_state: bool = True) -> dict:
        """The rows changed by the updates after the ``steps``-th, with their optimizer state (unless not
        ``optimizer_state``) and this shard's local row indices: what
        :func:`~sparkdl.ps.shards.apply_table_changes` lays over the state saved then."""
        rows = torch.nonzero(self.changed_at > steps).flatten()
        changes = {"rows": rows, "weight": self.weight.index_select(0, rows), "steps": self.steps}
        for key in ROW_STATE_KEYS if optimizer_state else ():
            value = getattr(self, key)
            if value is not None:
                changes[key] = value.index_select(0, rows)
        return changes

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (no row counts as changed since)."""
        if state["weight"].shape != self.weight.shape:
            raise ValueError(f"table {self.spec.name!r}: the saved rows are {tuple(state['weight'].shape)}, "
                             f"this shard holds {tuple(self.weight.shape)}")
        self.weight.copy_(state["weight"])     # in place: a table this size is held once
        self.steps = int(state["steps"])
        self.changed_at.zero_()
        state = with_state_of(state, self.spec.optimizer)
        for key in ROW_STATE_KEYS:
            current = getattr(self, key)
            if key not in state:
                setattr(self, key, None)
            elif current is not None and current.shape == state[key].shape:
                current.copy_(state[key])
            else:
                setattr(self, key, state[key].clone())
