"""One pull per model call for every table whose ids come straight from one of the model's inputs.

A :class:`~sparkdl._internal.ps.worker.remote_embedding.RemoteEmbedding` pulls its rows inside the
forward, where its ids are known: models hash, offset or combine ids before a lookup.  Most lookups,
though, take an input column as it is (``self.user(user)``), and then the ids are known before the
model runs.  :class:`TablePrefetch` learns which: on a call of the model it notes, for each table,
whether its ids were one of the call's input tensors (the same object, unchanged); from the next call
on, a forward pre-hook pulls the rows of every such table in one request before the model runs
(``PULL_TABLES``: one round trip for all of them), and each table takes its rows when it is called
with that input.  A table once called with other ids (computed, changed in place, another input than
last time, or two fields sharing the table) pulls its own inside the forward from then on, as before.

The rows are the ones the forward would have pulled: between the model's call and its lookups the
worker sends nothing, so under ``sync`` no update can land in between (a round needs this worker's
push) and the run stays equal to one process; under the asynchronous policies the rows are older by
at most the time from the call to the lookup, within the step's own staleness.

Under ``sync`` the training loop reads the next mini-batch before a push: :meth:`plan_ahead` plans the
next call's pull from its inputs and the worker sends it right behind the push, in the same write; the
PS answers it once the push is answered, so the step waits on one round trip for both, and
:meth:`receive_ahead` keeps the rows for the call with exactly those inputs.  They are the round's rows,
as a pull before the next forward would read them (the round needs this worker's next push to move on).
The asynchronous policies keep the pull before the call, which the PS serves while the worker reads and
plans its batch (behind the push it measured slower on two shared cores).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from sparkdl.errors import DataError

if TYPE_CHECKING:
    from sparkdl._internal.ps.worker.remote_embedding import RemoteEmbedding, RowSource


class _Pulled:
    """A table's rows pulled ahead of its lookup, for the input tensor they were pulled for."""

    __slots__ = ("input", "input_version", "ids", "local", "rows")

    def __init__(self, input: torch.Tensor, ids: torch.Tensor, local: torch.Tensor, rows: torch.Tensor) -> None:
        self.input, self.input_version = input, input._version   # an in-place change of the input voids them
        self.ids, self.local, self.rows = ids, local, rows

    def serves(self, input: torch.Tensor) -> bool:
        """Whether these rows were pulled for ``input`` as it is now (the same tensor, not changed since)."""
        return self.input is input and self.input_version == input._version


class TablePrefetch:
    """Pulls, before each call of the model, the rows of the tables whose ids are an input of the call."""

    def __init__(self, source: RowSource) -> None:
        self.source = source
        #: table -> the position (among the call's tensor inputs) its ids came from last time
        self.fed_by: dict[RemoteEmbedding, int] = {}
        #: tables seen looking up other ids than the ones pulled ahead: they always pull their own
        self.own_pulls: set[RemoteEmbedding] = set()
        self.pulled: dict[RemoteEmbedding, _Pulled] = {}
        self.inputs: tuple[torch.Tensor, ...] = ()
        #: the next call's pulls planned ahead (table, its input, distinct ids, each id's index into them), and
        #: the rows that came for them
        self._planned: list[tuple[RemoteEmbedding, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.ahead: dict[RemoteEmbedding, _Pulled] = {}

    def install(self, model: nn.Module) -> None:
        """Run :meth:`before_call` before every call of ``model`` (its root module: a training step,
        a validation batch)."""
        model.register_forward_pre_hook(self.before_call, with_kwargs=True)

    def before_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pull, in one request, the rows of every table known to look up one of this call's inputs."""
        self.inputs = call_tensors(args, kwargs)
        self.pulled.clear()
        ahead, self.ahead = self.ahead, {}
        planned = []
        for table, ids in self._fed(self.inputs):
            got = ahead.get(table)
            if got is not None and got.serves(ids):
                self.pulled[table] = got       # pulled with the last push, for exactly this input
            else:
                planned.append((table, ids))
        if not planned:
            return
        # checked as the lookups check them (the same error, before anything is pulled)
        uniques = cast(list[tuple[torch.Tensor, torch.Tensor]], distinct_ids(planned))
        rows = self.source.pull_tables([(table.name, distinct) for (table, _), (distinct, _) in
                                        zip(planned, uniques, strict=True)])
        for (table, ids), (distinct, local), values in zip(planned, uniques, rows, strict=True):
            self.pulled[table] = _Pulled(ids, distinct, local, values)

    def plan_ahead(self, inputs: tuple[torch.Tensor, ...]) -> list[tuple[str, torch.Tensor]]:
        """The pulls of the next call, whose tensor ``inputs`` (:func:`call_tensors`) are known before this step's
        push: (table name, distinct ids) for each table fed by one of them.  Ids a lookup would refuse are left
        to that lookup (it raises as it would have)."""
        # ids that are not integers are left to their lookup (it raises), the other tables planned
        fed = [(table, ids) for table, ids in self._fed(inputs) if ids.dtype in (torch.int64, torch.int32)]
        found = distinct_ids(fed, skip_invalid=True)
        self._planned = [(table, ids, *pair) for (table, ids), pair in zip(fed, found, strict=True)
                         if pair is not None]
        return [(table.name, distinct) for table, _, distinct, _ in self._planned]

    def receive_ahead(self, rows: list[torch.Tensor] | None) -> None:
        """The rows of :meth:`plan_ahead`'s pulls (None: they were not sent), for the next call with those inputs."""
        planned, self._planned = self._planned, []
        if rows is not None:
            self.ahead = {table: _Pulled(ids, distinct, local, values)
                          for (table, ids, distinct, local), values in zip(planned, rows, strict=True)}

    def take(self, table: RemoteEmbedding, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(distinct ids, each input's index into them, their rows) pulled ahead for this lookup of ``table``
        with ``input``, or None: the table pulls them itself (and then calls :meth:`learn`)."""
        pulled = self.pulled.pop(table, None)
        if pulled is None:
            return None
        if not pulled.serves(input):
            self.fed_by.pop(table, None)    # its ids are not that input (any more): it pulls its own
            self.own_pulls.add(table)
            return None
        return pulled.ids, pulled.local, pulled.rows

    def _fed(self, inputs: tuple[torch.Tensor, ...]) -> list[tuple[RemoteEmbedding, torch.Tensor]]:
        """(table, its ids) for every table known to look up one of a call's tensor ``inputs``."""
        return [(table, inputs[position]) for table, position in self.fed_by.items() if position < len(inputs)]

    def learn(self, table: RemoteEmbedding, input: torch.Tensor) -> None:
        """``table`` pulled its own rows for ``input``: note whether ``input`` is one of the call's inputs."""
        if table in self.own_pulls:
            return
        # a second lookup in the same call (fields sharing the table) overrides the first: the next call's
        # first lookup then misses, and the table pulls its own from then on
        position = next((i for i, value in enumerate(self.inputs) if value is input), None)
        if position is not None:
            self.fed_by[table] = position


def distinct_ids(lookups: Sequence[tuple[RemoteEmbedding, torch.Tensor]], skip_invalid: bool = False
                 ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """For each (table, ids): the distinct ids on the host (sorted) and each id's index into them on the ids'
    device, the ids checked as the lookup checks them (a DataError; ``skip_invalid``: None for that lookup).

    Ids on a GPU cross to the host in one copy for all the lookups, so they cost the step one synchronisation
    with the device where checking, deduplicating and moving each table's ids there would cost several."""
    for table, ids in lookups:
        table.check_dtype(ids)
    on_device = [ids for _, ids in lookups if ids.device.type != "cpu"]
    copied = iter(torch.cat([ids.reshape(-1).to(torch.int64) for ids in on_device]).cpu()
                  .split([ids.numel() for ids in on_device])) if on_device else iter(())
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for table, ids in lookups:
        host = ids if ids.device.type == "cpu" else next(copied).view(ids.shape)
        distinct, local = torch.unique(host.to(torch.int64), return_inverse=True)
        # the sorted distinct ids' ends bound them all: two reads where a check of every id took four operations;
        # an id out of range is then found among all of them, for the error's position
        if distinct.numel() and (int(distinct[0]) < 0 or int(distinct[-1]) >= table.num_embeddings):
            try:
                table.check_range(host)
            except DataError:
                if not skip_invalid:
                    raise
                found.append(None)
                continue
        found.append((distinct, local.to(ids.device, non_blocking=True)))
    return found


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """A call's tensor arguments, positional then keyword: how :class:`TablePrefetch` numbers a call's inputs."""
    return tuple(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
