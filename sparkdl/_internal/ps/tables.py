"""What an embedding table is, on both sides of the wire: its spec, its row optimizers' state keys, and
the helpers the workers and the shards share (coalescing rows, sizing messages, digests).

The parameter server's own copy of a table, with its optimizer, is
:class:`sparkdl._internal.ps.server.embedding_table.EmbeddingTable`.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparkdl.config import TrainConfig

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
