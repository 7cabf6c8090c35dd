"""The server's reply scheduler (bps_tf/core/reply_scheduler.h): sums go back
to each worker in the pushes' priority order, at most a credit of bytes
handed to libzmq at once. Driven through a probe in the core module: no
server, no network, no TensorFlow."""
import pytest

from bps_tf.runtime.loader import load_core

core = load_core()


def test_replies_leave_in_priority_order_then_oldest_first():
    probe = core.ReplyProbe(workers=1, credit=10_000)
    for tag, prio in enumerate([-3, 0, -1, 5, 0]):
        probe.add(worker=0, priority=prio, bytes=100, tag=tag)
    assert [tag for _, tag in probe.ready()] == [3, 1, 4, 2, 0]
    assert probe.queued == 0


def test_the_credit_holds_replies_back_until_libzmq_frees_earlier_ones():
    probe = core.ReplyProbe(workers=1, credit=250)
    for tag in range(4):
        probe.add(worker=0, priority=0, bytes=100, tag=tag)
    assert [t for _, t in probe.ready()] == [0, 1]      # a third would make 300 > 250
    assert probe.queued == 2 and probe.ready() == []
    # An urgent sum that arrives now waits only for the credit, not for the
    # bulk sums queued before it.
    probe.add(worker=0, priority=9, bytes=100, tag=9)
    probe.release(1)
    assert probe.wakes == 1                               # the server loop is woken
    assert [t for _, t in probe.ready()] == [9]
    probe.release(2)
    assert [t for _, t in probe.ready()] == [2, 3]
    probe.release(2)
    assert probe.wakes == 5 and probe.queued == 0


def test_each_worker_has_its_own_credit():
    probe = core.ReplyProbe(workers=2, credit=100)
    probe.add(worker=0, priority=0, bytes=100, tag=0)
    probe.add(worker=0, priority=0, bytes=100, tag=1)
    probe.add(worker=1, priority=0, bytes=100, tag=2)
    assert sorted(probe.ready()) == [(0, 0), (1, 2)]     # worker 1 is not held by worker 0
    probe.release(2)
    assert probe.ready() == [(0, 1)]


def test_a_reply_larger_than_the_credit_still_leaves_alone():
    probe = core.ReplyProbe(workers=1, credit=100)
    probe.add(worker=0, priority=0, bytes=1000, tag=0)
    probe.add(worker=0, priority=0, bytes=10, tag=1)
    assert probe.ready() == [(0, 0)]
    probe.release(1)
    assert probe.ready() == [(0, 1)]


def test_no_credit_sends_everything_at_once_in_priority_order():
    probe = core.ReplyProbe(workers=1, credit=0)
    for tag, prio in enumerate([1, 2, 3]):
        probe.add(worker=0, priority=prio, bytes=1 << 20, tag=tag)
    assert [t for _, t in probe.ready()] == [2, 1, 0]


@pytest.mark.parametrize("priority,want", [(-5, -5), (0, 0), (7, 7), (-(2 ** 40), -(2 ** 31)),
                                           (2 ** 40, 2 ** 31 - 1), (-1048576, -1048576)])
def test_a_push_carries_its_priority_beside_its_flags(priority, want):
    got, flags = core.push_priority_roundtrip(priority, 3)
    assert got == want and flags == 3


@pytest.mark.parametrize("parts,group,stagger,want", [
    (5, 2, 0, [0, 1, 2, 3, 4]),
    (5, 2, 1, [1, 0, 3, 2, 4]),            # the short last group has one partition
    (7, 3, 4, [1, 2, 0, 4, 5, 3, 6]),      # rank 4 of 3 servers starts each group at 1
    (4, 1, 3, [0, 1, 2, 3])])              # one server: no stagger
def test_workers_start_each_group_of_partitions_at_a_different_server(parts, group, stagger,
                                                                      want):
    # Consecutive partitions go to different servers, so workers that start
    # each group at a different one do not all feed one server at once; yet
    # every worker finishes a group before the next, so sums complete early.
    order = core.partition_send_order(parts, group, stagger)
    assert order == want
    for start in range(0, parts, group):
        assert sorted(order[start:start + group]) == list(range(start, min(start + group, parts)))


@pytest.mark.parametrize("env,text,why", [
    ("BYTEPS_TCP_NOTSENT_LOWAT", "-1", "0 (off) or a number of bytes"),
    ("BYTEPS_SERVER_CREDIT", "-2", "-1 (no limit)"),
    ("BYTEPS_SERVER_CREDIT", "lots", "is not valid"),
    ("BYTEPS_SCHEDULING_BURST_MS", "-1", "number of milliseconds"),
    ("BYTEPS_SCHEDULING_BURST_GAP_MS", "inf", "number of milliseconds")])
def test_a_bad_queue_setting_is_refused_not_silently_turned_off(env, text, why):
    from bps_tf.runtime import config
    with pytest.raises(ValueError, match=f"{env}='{text}' is not valid") as err:
        config.core_settings({env: text})
    assert why in str(err.value)
    assert config.core_settings({env: "-1" if env == "BYTEPS_SERVER_CREDIT" else "0"})


def test_a_burst_of_enqueues_limits_the_credit_until_a_pause_or_its_limit():
    # A worker keeps one partition in flight while a burst of operations is
    # still arriving (core/burst.h): until the gap (1 ms) after the latest
    # one, and never longer than the limit (10 ms) from the burst's first.
    ms = 0.001
    left = core.burst_limit_left(10 * ms, ms, [0, 0.2 * ms, 0.4 * ms],
                                 [0, 0.3 * ms, 1.3 * ms, 1.5 * ms])
    assert left == pytest.approx([ms, 0.9 * ms, 0.1 * ms, 0], abs=1e-9)
    # Enqueues every 0.5 ms for 20 ms: one burst, limited for its first 10 ms.
    steady = [i * 0.5 * ms for i in range(40)]
    left = core.burst_limit_left(10 * ms, ms, steady, [5 * ms, 9.9 * ms, 10.1 * ms, 19.6 * ms])
    assert left == pytest.approx([ms, 0.1 * ms, 0, 0], abs=1e-9)
    # A pause of at least the gap ends a burst; the next enqueue starts another.
    left = core.burst_limit_left(10 * ms, ms, [0, 0.5 * ms, 20 * ms, 40 * ms],
                                 [2 * ms, 20.1 * ms, 21.5 * ms, 40 * ms])
    assert left == pytest.approx([0, 0.9 * ms, 0, ms], abs=1e-9)
    # BYTEPS_SCHEDULING_BURST_MS=0: never limited.
    assert core.burst_limit_left(0, ms, [0, 0.1 * ms], [0.1 * ms]) == [0]
