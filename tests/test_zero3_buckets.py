"""ZeRO buckets on one rank: a ZeRO-3 bucket's references and storage change together (a
consumer releasing the last reference on one thread and a gather materializing the next
microbatch's copy on another never leave a referenced bucket without storage), and a
microbatch's handed-over gradients count as memory until their reduction is done."""
import functools
import threading

import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.nodes import Kind
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe
from piper_plugin.runtime import comm_ops
from piper_plugin.runtime.rank_state import RankState
from piper_plugin.scheduler.plan import build_plan


def _rank_state(zero: int):
    """Rank 0 of a one-stage toy LM on dp=2 with ZeRO ``zero``, and its plan."""
    torch.manual_seed(0)
    model, cfg = build_toy_lm(stages=1, layers=1)
    x, y = lm_batch(cfg, 8)
    program = capture(model, lm_loss, (x,), y)
    sch = apply_recipe(Schedule(program, pp=1, dp=2), "1f1b", microbatches=4, zero=zero)
    plan = build_plan(sch.dag, sch.grid)
    return plan, RankState(0, plan, program, model, lm_loss, functools.partial(torch.optim.SGD, lr=0.1))

def test_release_and_the_next_gather_do_not_interleave():
    plan, state = _rank_state(zero=3)
    first, second = sorted((n for n in plan.dag.nodes.values() if n.kind == Kind.ALL_GATHER and n.phase == "F"),
                           key=lambda n: n.microbatch)[:2]
    bucket = state.buckets[(first.region, first.bucket)]
    full = torch.randn(bucket.padded)
    comm_ops.absorb(state, first, full)  # microbatch 0's gather: its forward holds the bucket
    assert bucket.refs == 1 and bucket.materialized

    release = bucket.release
    releasing, go_on = threading.Event(), threading.Event()

    def held_release() -> None:  # the last reference is gone; the free waits for the gather below
        releasing.set()
        go_on.wait(timeout=30)
        release()

    bucket.release = held_release
    (consumer,) = plan.dag.data_succ[first.key]
    done = threading.Thread(target=state.finished, args=(consumer,))
    done.start()
    assert releasing.wait(timeout=30), "the consumer never released the bucket"
    # microbatch 1's gather lands while the release is under way: it must wait for the free (then
    # give the storage back) or have taken its reference before it; it gets 2 s to finish first
    gather = threading.Thread(target=comm_ops.absorb, args=(state, second, full))
    gather.start()
    gather.join(timeout=2.0)
    go_on.set()
    done.join(timeout=30)
    gather.join(timeout=30)
    assert not done.is_alive() and not gather.is_alive()
    assert bucket.refs == 1
    assert bucket.materialized, "a referenced bucket lost its storage to the release before it"
    expected = torch.zeros(bucket.padded)
    bucket.from_rank_major(full, expected)
    assert torch.equal(bucket.flat, expected)


def test_a_handed_over_gradient_counts_until_it_is_reduced():
    """ZeRO-2/3: a backward hands its microbatch's gradients to a reduce-scatter on another
    stream; they are memory until the reduction is done, not only until it starts."""
    plan, state = _rank_state(zero=2)
    node = next(n for n in plan.dag.nodes.values() if n.kind == Kind.REDUCE_SCATTER and n.phase == "B")
    bucket = state.buckets[(node.region, node.bucket)]
    before = state.meter.current
    state.deliver_to(node.key, "grads", bucket.flat_grad(take=True))
    held = state.meter.current - before
    assert held == bucket.grad_numel * 4  # gradients and flags, in rank-major layout
    grads = comm_ops.payload(state, node)
    assert state.meter.current - before == held, "still in use by the reduction"
    comm_ops.absorb(state, node, grads.chunk(2)[0].clone())
    assert state.meter.current == before


def test_a_gather_fills_the_bucket_unless_a_copy_is_held():
    """The first gather of a released bucket gives the bucket its storage back (the gathered
    parameters go there); while that copy is held, later gathers leave it and the copy serves."""
    plan, state = _rank_state(zero=3)
    first, second = sorted((n for n in plan.dag.nodes.values() if n.kind == Kind.ALL_GATHER and n.phase == "F"),
                           key=lambda n: n.microbatch)[:2]
    bucket = state.buckets[(first.region, first.bucket)]
    assert not bucket.materialized
    assert comm_ops.gather_target(state, first)
    assert bucket.materialized and bucket.refs == 1
    assert state.meter.current == bucket.padded * 4
    assert not comm_ops.gather_target(state, second) and bucket.refs == 2
    for node in (first, second):
        (consumer,) = plan.dag.data_succ[node.key]
        state.finished(consumer)
    assert bucket.refs == 0 and not bucket.materialized and state.meter.current == 0


def test_rank_major_layout_cuts_each_parameter_like_torch_chunk():
    """Member j's block holds chunk j (``torch.chunk`` along dim 0) of every parameter, zero-padded
    to ceil(rows / n) rows; the layout round-trips, gradients included, for rows that do not
    divide, fewer rows than members, vectors and scalars."""
    from piper_plugin.runtime.buckets import FlatBucket

    torch.manual_seed(0)
    shapes = [(5, 3), (2,), (7, 2, 2), (), (1, 4), (8, 1)]
    for n in (1, 2, 3, 4):
        for index in range(n):
            params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
            originals = [p.detach().clone() for p in params]
            bucket = FlatBucket(params, zero=1, group_size=n, index_in_group=index)
            blocks = bucket.to_rank_major(bucket.flat).view(n, bucket.shard_numel)
            start = 0
            for p, seg in zip(originals, bucket.segments):
                rows = p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1)
                chunks = list(rows.chunk(n)) if rows.shape[0] else []
                for j in range(n):
                    got = blocks[j, start:start + seg]
                    want = chunks[j].reshape(-1) if j < len(chunks) else torch.zeros(0)
                    assert torch.equal(got[:want.numel()], want) and not got[want.numel():].any()
                start += seg
            out = torch.zeros(bucket.padded)
            bucket.from_rank_major(blocks.reshape(-1), out)
            assert torch.equal(out[:bucket.numel], torch.cat([p.reshape(-1) for p in originals]))
            for shard, p in zip(bucket.shards, originals):  # this member's rows, as views of the params
                rows = p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1)
                mine = list(rows.chunk(n))
                assert torch.equal(shard.detach().reshape(-1),
                                   mine[index].reshape(-1) if index < len(mine) else torch.zeros(0))
            for p in params:
                p.grad = torch.ones_like(p)
            grads = bucket.flat_grad().view(n, bucket.shard_numel + bucket.flags)
            assert torch.equal(grads[:, bucket.shard_numel:], torch.ones(n, len(params)))
            assert grads[:, :bucket.shard_numel].sum() == sum(p.numel() for p in params)


def _poster(posted: list):
    """A pairwise exchange that records its ``(peer, into, send)`` messages in ``posted``."""
    return lambda triples: posted.extend(triples) or [(None, None)] * len(triples)


def _deliver(posted: list[list]) -> None:
    """Deliver every member's posted messages (``posted[i]``: member i's, in order) to their
    peer, in the order posted, and clear them."""
    for i, mine in enumerate(posted):
        for j, theirs in enumerate(posted):
            into = [t[1] for t in mine if t[0] == j]
            sent = [t[2] for t in theirs if t[0] == i]
            assert len(into) == len(sent)
            for a, b in zip(into, sent):
                a.copy_(b)
    for mine in posted:
        mine.clear()


def test_pairwise_exchanges_match_the_rank_major_collectives():
    """On gloo a block whose rows split evenly moves as pairwise messages per parameter and peer,
    straight into the parameters and from the gradients (``gather_pairwise``,
    ``reduce_pairwise``). n members, simulated here by delivering each member's messages to
    their peer in the order posted, end with every parameter whole and with exactly the
    rank-major reduce-scatter's block and flags, a parameter without a gradient included."""
    from piper_plugin.runtime.buckets import FlatBucket

    torch.manual_seed(0)
    for n in (1, 2, 3):
        shapes = [(2 * n, 3), (n,), (3 * n, 2, 2), (n, 4)]
        values = [torch.randn(s) for s in shapes]
        members = [FlatBucket([torch.nn.Parameter(v.clone()) for v in values], zero=3, group_size=n,
                              index_in_group=i) for i in range(n)]
        assert all(b.in_place for b in members)

        posted = [[] for _ in members]
        for i, bucket in enumerate(members):
            bucket.gather_pairwise(_poster(posted[i]))
        _deliver(posted)
        for bucket in members:
            assert all(torch.equal(p.detach(), v) for p, v in zip(bucket.params, values))

        grads = [[torch.randn(s) if k != 1 or i == 0 else None for k, s in enumerate(shapes)] for i in range(n)]
        results, wants = [], []
        for i, (bucket, mine) in enumerate(zip(members, grads)):
            for p, g in zip(bucket.params, mine):
                p.grad = g
            wants.append(bucket.flat_grad(take=False).view(n, -1))  # rank-major, flags per block
            works, out, _ = bucket.reduce_pairwise(_poster(posted[i]))
            assert all(p.grad is None for p in bucket.params)
            results.append((works, out))
        _deliver(posted)
        for i, (works, out) in enumerate(results):
            if works:
                works[-1][1]()
            assert torch.allclose(out, sum(w[i] for w in wants), atol=1e-6)


def test_rank_major_pairwise_collectives_for_uneven_rows():
    """A bucket whose rows do not split evenly moves one rank-major block per peer: n members,
    simulated by delivering each one's messages to its peer, gather every member's block and
    reduce-scatter to the sum of the members' blocks, in member order."""
    from piper_plugin.runtime.group_collectives import GroupCollectives

    torch.manual_seed(0)
    for n in (2, 3):
        members, posted = [], [[] for _ in range(n)]
        for i in range(n):
            ops = object.__new__(GroupCollectives)
            ops.group, ops.index, ops.n, ops.pairwise = None, i, n, True
            ops.peers = [j for j in range(n) if j != i]
            post = _poster(posted[i])
            ops.exchange = lambda triples, tag, post=post: post(triples)
            members.append(ops)

        shards = [torch.randn(5) for _ in range(n)]
        outs = [torch.empty(5 * n) for _ in range(n)]
        for ops, shard, out in zip(members, shards, outs):
            ops.gather(out, shard)
        _deliver(posted)
        assert all(torch.equal(out, torch.cat(shards)) for out in outs)

        sources = [torch.randn(n * 7) for _ in range(n)]
        results, issued = [torch.empty(7) for _ in range(n)], []
        for ops, src, out in zip(members, sources, results):
            issued.append(ops.reduce_scatter(out, src))
        _deliver(posted)
        for i, (works, out) in enumerate(zip(issued, results)):
            works[-1][1]()
            want = sources[0].view(n, 7)[i].clone()
            for src in sources[1:]:
                want += src.view(n, 7)[i]
            assert torch.equal(out, want)


def test_replicas_of_a_plan_sum_their_reduced_gradients_and_flags():
    """``sum_over_replicas``: two replicas of one plan rank, with a parameter only one of them
    has a gradient for, end with the sum of both replicas' gradients and that parameter's
    gradient on both (ZeRO-0: the whole gradients; ZeRO-1: this member's shard rows)."""
    from piper_plugin.runtime.buckets import FlatBucket

    torch.manual_seed(0)
    for zero in (0, 1):
        replicas, grads = [], []
        for r in range(2):
            params = [torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(4))]
            bucket = FlatBucket(params, zero, group_size=2, index_in_group=0)
            g = [torch.randn(6, 3), torch.randn(4) if r == 1 else None]  # the bias: replica 1 only
            grads.append(g)
            if zero == 0:
                for p, gi in zip(params, g):
                    p.grad = gi
            else:  # this member's reduce-scatter result: its rows and the flags
                rows = torch.cat([g[0][:3].reshape(-1), g[1][:2] if g[1] is not None else torch.zeros(2)])
                bucket.add_shard_grad(torch.cat([rows, torch.tensor([1.0, float(g[1] is not None)])]))
            replicas.append(bucket)
        payloads = []
        for bucket in replicas:  # what each replica contributes, collected before any sum
            bucket.sum_over_replicas(lambda t: payloads.append(t.clone()))
        total = payloads[0] + payloads[1]
        for bucket in replicas:
            bucket.sum_over_replicas(lambda t: t.copy_(total))
            if zero == 0:
                weight, bias = (p.grad for p in bucket.params)
                assert torch.equal(weight, grads[0][0] + grads[1][0]) and torch.equal(bias, grads[1][1])
            else:
                weight, bias = (s.grad for s in bucket.shards)
                assert torch.equal(weight, (grads[0][0] + grads[1][0])[:3]) and torch.equal(bias, grads[1][1][:2])
