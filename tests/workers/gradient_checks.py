"""Gradients of the collectives, checked against their definition.

Each rank r computes ``out_r = C(x_0, ..., x_{n-1})`` and a loss
``L_r = sum(c_r * out_r)`` with a constant ``c_r`` of its own. The gradient
every collective must give rank q is the derivative of the total loss
``sum_r L_r`` with respect to ``x_q``, scaled as Horovod scales it: an
allreduce's gradient is the allreduce of the gradients; a broadcast's is the
*average* of the gradients, on the root; an allgather's is this rank's slice
of the averaged gradient; a reducescatter's is the gathered gradients times
size(). Values are small integers, so every expectation is exact (an average
over 3 workers to one rounding).

``run(mode, rank, size)`` builds the same checks in eager mode, in a
``tf.function`` or in a TF1 graph (``mode="tf1"``: the caller has disabled
eager execution), and returns ``{collective: max abs error}``.
"""
import numpy as np
import tensorflow as tf

import bps_tf

ROWS = 2          # rows per rank of x (allgather: rank r has ROWS + r rows)
COLS = 3


def x_value(rank, rows=ROWS):
    return (np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) + 10 * rank)


def c_value(rank, shape):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 7 + rank + 1)


def expectations(rank, size):
    """{collective: gradient rank ``rank`` must get}, from the definition."""
    full = [c_value(r, (ROWS, COLS)) for r in range(size)]
    want = {
        "allreduce_sum": sum(full),
        "allreduce_average": sum(full) / size,
        "broadcast_root1": sum(full) / size if rank == 1 else np.zeros((ROWS, COLS), np.float32),
    }
    gathered_rows = sum(ROWS + r for r in range(size))
    total = sum(c_value(r, (gathered_rows, COLS)) for r in range(size))
    start = sum(ROWS + r for r in range(rank))
    want["allgather"] = total[start:start + ROWS + rank] / size
    # reducescatter(op=Sum) of [size * ROWS, COLS]: rank r keeps rows
    # [r * ROWS, (r + 1) * ROWS) of the sum, so x_q's gradient stacks each c_r.
    want["reducescatter_sum"] = size * np.concatenate([c_value(r, (ROWS, COLS))
                                                       for r in range(size)])
    # alltoall with even splits: x_q's block s goes to rank s, arriving as
    # block q of out_s, so its gradient is block q of c_s.
    blocks = []
    for s in range(size):
        c_s = c_value(s, (size * ROWS, COLS))
        blocks.append(c_s[rank * ROWS:(rank + 1) * ROWS])
    want["alltoall"] = np.concatenate(blocks)
    return want


def output_shapes(size):
    """Shapes of the outputs (graphs do not know them all statically)."""
    gathered_rows = sum(ROWS + r for r in range(size))
    return {"allreduce_sum": (ROWS, COLS), "allreduce_average": (ROWS, COLS),
            "broadcast_root1": (ROWS, COLS), "allgather": (gathered_rows, COLS),
            "reducescatter_sum": (ROWS, COLS), "alltoall": (size * ROWS, COLS)}


def loss(rank, size, key, out):
    return tf.reduce_sum(tf.constant(c_value(rank, output_shapes(size)[key])) * out)


def outputs(x, x_uneven, x_scatter, tag):
    """{collective: (output, input)} built from this rank's inputs."""
    return {
        "allreduce_sum": (bps_tf.allreduce(x, op=bps_tf.Sum, name=f"grad_{tag}_sum"), x),
        "allreduce_average": (bps_tf.allreduce(x, op=bps_tf.Average, name=f"grad_{tag}_avg"), x),
        "broadcast_root1": (bps_tf.broadcast(x, root_rank=1, name=f"grad_{tag}_bcast"), x),
        "allgather": (bps_tf.allgather(x_uneven, name=f"grad_{tag}_gather"), x_uneven),
        "reducescatter_sum": (bps_tf.reducescatter(x_scatter, op=bps_tf.Sum,
                                                   name=f"grad_{tag}_rs"), x_scatter),
        "alltoall": (bps_tf.alltoall(x_scatter, name=f"grad_{tag}_a2a"), x_scatter),
    }


def gradients_with_tape(rank, size, tag):
    x = tf.constant(x_value(rank))
    x_uneven = tf.constant(x_value(rank, ROWS + rank))
    x_scatter = tf.constant(x_value(rank, size * ROWS))
    with tf.GradientTape(persistent=True) as tape:
        for t in (x, x_uneven, x_scatter):
            tape.watch(t)
        outs = outputs(x, x_uneven, x_scatter, tag)
        losses = {k: loss(rank, size, k, out) for k, (out, _) in outs.items()}
    return {k: tape.gradient(losses[k], outs[k][1]) for k in outs}


def run(mode, rank, size):
    want = expectations(rank, size)
    if mode == "eager":
        got = {k: v.numpy() for k, v in gradients_with_tape(rank, size, "eager").items()}
    elif mode == "function":
        got = {k: v.numpy() for k, v in
               tf.function(lambda: gradients_with_tape(rank, size, "function"))().items()}
    elif mode == "tf1":
        x = tf.compat.v1.placeholder(tf.float32, [ROWS, COLS])
        x_uneven = tf.compat.v1.placeholder(tf.float32, [ROWS + rank, COLS])
        x_scatter = tf.compat.v1.placeholder(tf.float32, [size * ROWS, COLS])
        outs = outputs(x, x_uneven, x_scatter, "tf1")
        grads = {k: tf.gradients(loss(rank, size, k, out), inp)[0]
                 for k, (out, inp) in outs.items()}
        feed = {x: x_value(rank), x_uneven: x_value(rank, ROWS + rank),
                x_scatter: x_value(rank, size * ROWS)}
        with tf.compat.v1.Session() as session:
            # One collective per run: each must complete on its own.
            got = {k: session.run(g, feed) for k, g in grads.items()}
    else:
        raise ValueError(mode)
    errors = {}
    for k, w in want.items():
        g = np.asarray(got[k])
        if g.shape != w.shape:
            raise AssertionError(f"{mode} {k}: gradient shape {g.shape}, want {w.shape}")
        errors[k] = float(np.max(np.abs(g - w))) if g.size else 0.0
    # Exact, except averages over 3 workers: x / 3 may be computed as
    # x * (1 / 3), one rounding apart.
    bad = {k: e for k, e in errors.items()
           if e > (1e-6 * float(np.max(np.abs(want[k])))
                   if k in ("allreduce_average", "allgather", "broadcast_root1") else 0.0)}
    if bad:
        raise AssertionError(f"{mode}: gradients differ from the definition: {bad}")
    return errors
