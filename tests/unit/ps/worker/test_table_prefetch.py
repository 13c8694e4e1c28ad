"""A step's table lookups in one round trip: PULL_TABLES answers several tables at once (from one PS or its
shards), and the replica pulls the rows of every table whose ids are a model input before the model runs,
with the same rows, outputs and gradients as the lookups' own pulls."""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from sparkdl._internal.ps.server.embedding_table import EmbeddingTable
from sparkdl._internal.ps.tables import TableSpec
from sparkdl._internal.ps.wire import protocol
from sparkdl._internal.ps.worker.client import _byte_view
from sparkdl._internal.ps.worker.remote_embedding import prefetch_tables, swap_tables
from sparkdl._internal.ps.worker.sharded_client import ShardedClient
from sparkdl.errors import DataError, ParameterServerError
from tests.unit.conftest import SECRET, connect
from tests.unit.ps.server.test_embedding_table import ITEMS, USERS, Factorisation, Tables, batch


class CountingTables(Tables):
    """The in-process tables, counting the requests a replica makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.single, self.together = 0, 0

    def pull_rows(self, table, ids):
        self.single += 1
        return super().pull_rows(table, ids)

    def pull_tables(self, requests):
        self.together += 1
        return [Tables.pull_rows(self, table, ids) for table, ids in requests]


def replica(model: nn.Module, prefetch: bool) -> tuple[nn.Module, CountingTables]:
    model = copy.deepcopy(model)
    source = CountingTables(model, "sgd", 0.1)
    tables = swap_tables(model, source)
    if prefetch:
        prefetch_tables(model, tables, source)
    return model, source


def twins(model_class: type[nn.Module]) -> tuple[nn.Module, CountingTables, nn.Module, CountingTables]:
    """One model (seed 0) as two replicas: one pulling ahead of the call, one whose lookups pull their own."""
    torch.manual_seed(0)
    model = model_class()
    return (*replica(model, prefetch=True), *replica(model, prefetch=False))


def step(model: nn.Module, inputs) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    out = model(*inputs)
    out.sum().backward()
    touched = {name: module.take_touched() for name, module in model.named_modules() if hasattr(module, "take_touched")}
    return out.detach(), {name: (t.ids, t.grads) for name, t in touched.items()}


def assert_same_step(ahead: nn.Module, alone: nn.Module, inputs) -> None:
    """A step of both replicas on ``inputs()`` gives the same output and the same rows' gradients."""
    out, grads = step(ahead, inputs())
    reference_out, reference_grads = step(alone, inputs())
    assert torch.equal(out, reference_out)
    for name, (ids, grad) in reference_grads.items():
        assert torch.equal(grads[name][0], ids) and torch.equal(grads[name][1], grad), name


def test_the_tables_fed_by_inputs_are_pulled_together_before_the_call_with_the_same_rows_and_gradients():
    ahead, ahead_source, alone, alone_source = twins(Factorisation)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        users, items, tags, _ = batch(generator, 16)
        assert_same_step(ahead, alone, lambda: (users, items, tags))
    # the first call learns which input feeds each of the three tables; the next three pull them in one request
    assert (ahead_source.single, ahead_source.together) == (3, 3)
    assert (alone_source.single, alone_source.together) == (12, 0)


class Computed(nn.Module):
    """Ids that are not an input as given: offset before one lookup, changed in place before another, one
    table looked up twice (two fields sharing it), and one fed by another input on every other call."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Embedding(USERS + 1, 4, sparse=True)
        self.shifted = nn.Embedding(ITEMS, 4, sparse=True)
        self.pairs = nn.Embedding(USERS, 4, sparse=True)
        self.switching = nn.Embedding(USERS, 4, sparse=True)
        self.plain = nn.Embedding(USERS, 4, sparse=True)
        self.calls = 0

    def forward(self, users, items, others):
        self.calls += 1
        shifted = self.shifted(items.sub_(1))    # in place: the input's values change before the lookup
        pair = self.pairs(users) * self.pairs(others)
        switching = self.switching(users if self.calls % 2 else others)
        return (self.offset(users + 1) * shifted * pair * switching * self.plain(users)).sum(-1)


def test_computed_changed_in_place_or_shared_ids_pull_their_own_rows():
    ahead, ahead_source, alone, _ = twins(Computed)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        users = torch.randint(0, USERS, (8,), generator=generator)
        items = torch.randint(1, ITEMS, (8,), generator=generator)
        others = torch.randint(0, USERS, (8,), generator=generator)
        assert_same_step(ahead, alone, lambda: (users, items.clone(), others))
    # only "plain" (users as given, looked up once) and, until its input changed in place, "shifted" go ahead
    prefetch = ahead.plain.prefetch
    assert set(prefetch.fed_by) == {ahead.plain}
    assert prefetch.own_pulls == {ahead.pairs, ahead.shifted, ahead.switching}


def two_tables() -> list[EmbeddingTable]:
    return [EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="sgd"), learning_rate=0.1),
            EmbeddingTable(TableSpec("items", rows=12, dim=2, optimizer="sgd"), learning_rate=0.1)]


def test_one_pull_tables_answers_every_table_in_one_round_trip(make_server):
    tables = two_tables()
    server = make_server(num_params=2, server_args={"tables": tables})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    users, items = torch.tensor([1, 4, 19]), torch.tensor([0, 11])
    got = client.pull_tables([(0, users, 3), (1, items, 2)])
    assert torch.equal(got[0], tables[0].weight[users]) and torch.equal(got[1], tables[1].weight[items])
    assert client.round_trips == 1


@pytest.mark.parametrize("layout", ["same-table-twice", "unknown-table", "short"])
def test_a_malformed_pull_tables_loses_the_connection_and_changes_nothing(make_server, layout):
    tables = two_tables()
    server = make_server(num_params=2, server_args={"tables": tables})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    before = [t.weight.clone() for t in tables]
    table_list = {"same-table-twice": [0, 0], "unknown-table": [0, 2], "short": [0, 1]}[layout]
    counts = [1, 1] if layout != "short" else [1, 3]      # "short": three ids announced, one sent
    asked = torch.tensor(table_list + counts + [2, 3], dtype=torch.int64)
    length = 8 * asked.numel() if layout != "short" else 8 * (asked.numel() + 2)
    protocol.send_message(client.sock, protocol.TablePull(0, 2, length).header(), _byte_view(asked))
    if layout == "short":
        client.sock.shutdown(1)    # the rest never comes
    with pytest.raises((ParameterServerError, ConnectionError, OSError)):
        client._read_reply(1 << 16, protocol.Msg.ROWS)
        protocol.recv_tensor(client.sock, torch.empty(4))
    assert server.stats.protocol_errors == (0 if layout == "short" else 1)
    assert all(torch.equal(t.weight, b) for t, b in zip(tables, before))


def test_a_sharded_pull_asks_each_shard_once_for_its_rows_of_every_table(make_server):
    shards = []
    for shard in range(2):
        held = [EmbeddingTable(TableSpec("users", rows=20, dim=3, optimizer="sgd"), shard, 2, 0.1),
                EmbeddingTable(TableSpec("items", rows=12, dim=2, optimizer="sgd"), shard, 2, 0.1)]
        shards.append((make_server(num_params=1, server_args={"tables": held, "shard": shard}), held))
    clients = [connect(server) for server, _ in shards]
    sharded = ShardedClient(clients, [(0, 1), (1, 2)], [], ("127.0.0.1", 1), SECRET, 10.0, None)   # pulls only
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: c.hello(64, torch.zeros(1)), clients))
    users, items = torch.tensor([1, 4, 19]), torch.tensor([2, 6])   # items only on shard 0
    got = sharded.pull_tables([(0, users, 3), (1, items, 2)])
    for t, (ids, values) in enumerate(((users, got[0]), (items, got[1]))):
        expected = torch.stack([shards[i % 2][1][t].weight[i // 2] for i in ids.tolist()])
        assert torch.equal(values, expected)
    assert [c.round_trips for c in clients] == [1, 1]
    sharded.pull_tables([(0, torch.tensor([0, 2]), 3), (1, items, 2)])    # every id on shard 0: shard 1 is not asked
    assert [c.round_trips for c in clients] == [2, 1]


def uncounted_rows(source: CountingTables, requests) -> list[torch.Tensor]:
    """The rows a pull behind the push brings, read without counting a request of the replica's."""
    return [Tables.pull_rows(source, table, ids) for table, ids in requests]


def test_rows_planned_from_the_next_inputs_serve_that_call_without_a_request_and_only_that_call():
    """The worker plans the next call's pull from its inputs before a push (the loop reads the batch ahead) and the
    rows come with the push's reply: that call pulls nothing; a call with other input tensors (equal values, other
    objects, or changed in place) pulls as before.  Outputs and rows' gradients equal the lookups' own pulls."""
    from sparkdl._internal.ps.worker.table_prefetch import call_tensors

    ahead, source, alone, _ = twins(Factorisation)
    prefetch = ahead.users.prefetch
    generator = torch.Generator().manual_seed(1)
    inputs = batch(generator, 16)[:3]
    assert_same_step(ahead, alone, lambda: inputs)          # learns which input feeds each table: 3 pulls
    for _ in range(3):
        inputs = batch(generator, 16)[:3]
        planned = prefetch.plan_ahead(call_tensors(inputs, {}))
        assert sorted(name for name, _ in planned) == ["items", "tags", "users"]
        prefetch.receive_ahead(uncounted_rows(source, planned))    # as the push's write brings them
        assert_same_step(ahead, alone, lambda: inputs)
    assert (source.single, source.together) == (3, 0)
    # planned for one batch, called with a copy of it: the rows are not taken, the call pulls them itself
    prefetch.receive_ahead(uncounted_rows(source, prefetch.plan_ahead(call_tensors(inputs, {}))))
    assert_same_step(ahead, alone, lambda: tuple(t.clone() for t in inputs))
    assert (source.single, source.together) == (3, 1)
    prefetch.receive_ahead(uncounted_rows(source, prefetch.plan_ahead(call_tensors(inputs, {}))))
    inputs[0].add_(0)                                         # changed in place after the plan
    assert_same_step(ahead, alone, lambda: inputs)
    assert (source.single, source.together) == (3, 2)


def test_a_pull_sent_behind_a_push_is_answered_after_it_in_one_round_trip(make_server):
    """The PS answers the pull once the push is answered: the rows are the ones the push's rows updated."""
    tables = two_tables()
    server = make_server(num_params=2, learning_rate=0.1, server_args={"tables": tables})
    client = connect(server)
    client.hello(64, torch.zeros(2))
    users, items = torch.tensor([1, 4]), torch.tensor([3])
    expected = tables[0].weight[users] - 0.1              # the push's rows, stepped by SGD at 0.1
    client.push_rows(0, users, torch.ones(2, 3))
    client.pull_after_push([(0, users, 3), (1, items, 2)])
    assert client.push_pull(torch.ones(2), 0, 8, 0.0, 0, torch.zeros(2)) == (1, True)
    rows = client.rows_after_push
    assert rows is not None and torch.allclose(rows[0], expected) and torch.equal(rows[1], tables[1].weight[items])
    assert client.round_trips == 1
    client.push_pull(torch.ones(2), 1, 8, 0.0, 0, torch.zeros(2))     # nothing queued: nothing pulled
    assert client.round_trips == 2 and client.rows_after_push is None


def test_distinct_ids_of_several_lookups_match_torch_unique_and_leave_invalid_ones_to_their_lookup():
    from sparkdl._internal.ps.worker.table_prefetch import distinct_ids

    model, _ = replica(Factorisation(), prefetch=False)
    users, items = model.users, model.items
    good = torch.tensor([[3, 1], [3, 7]])
    bad = torch.tensor([ITEMS + 5, 0])
    found = distinct_ids([(users, good), (items, bad)], skip_invalid=True)
    distinct, local = torch.unique(good, return_inverse=True)
    assert torch.equal(found[0][0], distinct) and torch.equal(found[0][1], local) and found[1] is None
    with pytest.raises(Exception, match=f"table 'items' has {ITEMS} rows"):
        distinct_ids([(users, good), (items, bad)])
    # either end of the range, in either id dtype: refused with the id's position, or left to the lookup
    below, above = torch.tensor([[0, 2], [-1, 3]]), torch.tensor([[0, USERS], [1, 3]])
    for ids, wrong, position in ((below, -1, r"\(1, 0\)"), (above, USERS, r"\(0, 1\)")):
        for dtype in (torch.int64, torch.int32):
            assert distinct_ids([(users, ids.to(dtype))], skip_invalid=True) == [None]
            with pytest.raises(DataError, match=f"holds id {wrong} at position {position}"):
                distinct_ids([(users, ids.to(dtype))])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ids_on_a_gpu_cross_to_the_host_once_and_their_indices_stay_on_the_gpu():
    from sparkdl._internal.ps.worker.table_prefetch import distinct_ids

    model, _ = replica(Factorisation(), prefetch=False)
    users_ids, items_ids = torch.tensor([[3, 1], [3, 7]]), torch.tensor([2, 2, 0], dtype=torch.int32)
    on_gpu = distinct_ids([(model.users, users_ids.cuda()), (model.items, items_ids.cuda())])
    on_cpu = distinct_ids([(model.users, users_ids), (model.items, items_ids)])
    for (gpu_distinct, gpu_local), (cpu_distinct, cpu_local) in zip(on_gpu, on_cpu, strict=True):
        assert gpu_distinct.device.type == "cpu" and torch.equal(gpu_distinct, cpu_distinct)
        assert gpu_local.device.type == "cuda" and torch.equal(gpu_local.cpu(), cpu_local)


class SharedUserTable(nn.Module):
    """One table looked up twice in a call (two fields sharing it): its touched rows are coalesced."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, 4, sparse=True)

    def forward(self, first, second):
        return (self.users(first) * self.users(second)).sum(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_table_looked_up_twice_on_a_gpu_coalesces_its_rows_as_on_the_cpu():
    torch.manual_seed(0)
    model = SharedUserTable()
    first, second = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 1])
    (on_gpu, _), (on_cpu, _) = replica(model, prefetch=False), replica(model, prefetch=False)
    _, gpu_touched = step(on_gpu, (first.cuda(), second.cuda()))
    _, cpu_touched = step(on_cpu, (first, second))
    (gpu_ids, gpu_grads), (cpu_ids, cpu_grads) = gpu_touched["users"], cpu_touched["users"]
    assert torch.equal(gpu_ids, cpu_ids) and torch.allclose(gpu_grads, cpu_grads)
