"""An elastic training loop with Horovod's elastic contract, without
TensorFlow (numpy through the core), for tests/test_elastic_hosts.py.

It has the shape of the scripts horovodrun's elastic scenarios run: a state
with ``epoch``/``batch``/``commits``/``rendezvous`` and a "model" ``w``,
committed every ``--batches-per-commit`` batches and at every epoch's end;
rank 0 appends one JSON line per epoch to ``--logfile`` (its start rank and
host from HOROVOD_RANK / HOROVOD_HOSTNAME, its rank, the size, the
rendezvous count, ``w``), and when ``--discovery-schedule`` says the hosts
change after an epoch, waits for the notice in ``state._host_messages``
(at most ``--discovery-wait`` s). ``--exit-schedule`` makes the workers of
the given start ranks fail at (epoch, batch): by exception or SIGKILL.

Each step adds the average over the workers of 1.0 to ``w``: after training
``w`` equals the number of steps trained, exactly, only if no step was
lost or trained twice across the changes (a rollback retrains the steps
after the commit; a leave keeps everything).

Also, for the recovery-time check: with ``--times FILE`` every worker appends
``{"event", "time", ...}`` lines: ``kill`` right before a worker kills
itself, ``step`` after each first step of a membership.
"""
import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from bps_tf.runtime import basics
from bps_tf.runtime import elastic_state as elastic

parser = argparse.ArgumentParser()
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--epoch-wait", type=float, default=0.0)
parser.add_argument("--batch-wait", type=float, default=0.0)
parser.add_argument("--logfile", required=True)
parser.add_argument("--discovery-schedule", default="[]")
parser.add_argument("--discovery-wait", type=float, default=3)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", default="exception")
parser.add_argument("--times", default="")
# Our tests' own schedules, by launch id (BYTEPS_LAUNCH_ID, unique per process):
# {"(epoch, batch)": [ids]} to SIGKILL / SIGTERM themselves there.
parser.add_argument("--kill-schedule", default="{}")
parser.add_argument("--term-schedule", default="{}")
parser.add_argument("--newcomer-delay", default="{}", help='{"launch id": seconds before joining}')
parser.add_argument("--no-final-check", action="store_true",
                    help="the last epoch's end saves without checking for host updates "
                         "(as model.fit's end does)")
args = parser.parse_args()
LAUNCH_ID = os.environ.get("BYTEPS_LAUNCH_ID", "")
time.sleep(float(json.loads(args.newcomer_delay).get(LAUNCH_ID, 0)))

basics.join()
HOSTNAME = os.environ.get("HOROVOD_HOSTNAME")
START_RANK = int(os.environ.get("HOROVOD_RANK", "0"))
schedule = json.loads(args.discovery_schedule)
epoch_hosts = {e: h for e, h in schedule if e is not None}
default_hosts = schedule[-1][1] if schedule else []
exits = json.loads(args.exit_schedule)


def note(event, **data):
    if args.times:
        with open(args.times, "a") as f:
            f.write(json.dumps(dict(data, event=event, time=time.time(), start_rank=START_RANK,
                                    pid=os.getpid())) + "\n")


class State(elastic.ObjectState):
    """Attributes plus ``w``, committed, restored and synced with them."""

    def __init__(self, **kwargs):
        self.w = 0.0
        self._w = 0.0
        super().__init__(**kwargs)

    def save(self):
        self._w = self.w
        super().save()

    def restore(self):
        self.w = self._w
        super().restore()

    def sync(self):
        self._w = elastic.broadcast_object(self._w, name="test.w")
        self.w = self._w
        super().sync()


def step(state):
    out = np.empty(1, np.float64)
    basics.core().push_pull_async("test.step", np.ones(1, np.float64), out).wait(-1)
    state.w += float(out[0]) / basics.size()


def check_exit(epoch, batch):
    key = str((epoch, batch))
    if LAUNCH_ID in json.loads(args.kill_schedule).get(key, []):
        note("kill", launch_id=LAUNCH_ID)
        os.kill(os.getpid(), signal.SIGKILL)
    if LAUNCH_ID in json.loads(args.term_schedule).get(key, []):
        note("term", launch_id=LAUNCH_ID)
        os.kill(os.getpid(), signal.SIGTERM)
    if START_RANK in exits.get(key, []):
        if args.exit_mode == "exception":
            raise RuntimeError(f"exit scheduled at epoch {epoch} batch {batch}, start rank "
                               f"{START_RANK}, rank {basics.rank()}")
        note("kill")
        os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    state.rendezvous += 1
    first = True
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            check_exit(state.epoch, state.batch)
            step(state)
            if first:
                note("step", rank=basics.rank(), size=basics.size(), launch_id=LAUNCH_ID,
                     epoch=state.epoch, batch=state.batch)
                first = False
            if args.batch_wait:
                time.sleep(args.batch_wait)
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commits += 1
                state.commit()
        if basics.rank() == 0:
            with open(args.logfile, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "batch": state.batch,
                                    "commits": state.commits, "hostname": HOSTNAME,
                                    "start_rank": START_RANK, "rank": basics.rank(),
                                    "size": basics.size(), "rendezvous": state.rendezvous,
                                    "w": state.w}) + "\n")
            now_hosts = epoch_hosts.get(state.epoch, default_hosts)
            next_hosts = epoch_hosts.get(state.epoch + 1, default_hosts)
            if args.discovery_wait > 0 and now_hosts != next_hosts:
                since = time.time()
                while state._host_messages.empty():  # pylint: disable=protected-access
                    if time.time() - since > args.discovery_wait:
                        raise TimeoutError("no host update came from the launcher")
                    time.sleep(0.1)
        if args.epoch_wait:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        if args.no_final_check and state.epoch == args.epochs:
            state.save()
        else:
            state.commit()


state = State(epoch=0, batch=0, commits=0, rendezvous=0)
train(state)
note("done", rank=basics.rank(), size=basics.size(), w=state.w, launch_id=LAUNCH_ID,
     hostname=HOSTNAME, node_host=os.environ.get("DMLC_NODE_HOST"),
     host_exec=os.environ.get("BPS_TEST_HOST_EXEC"))
sys.exit(0)
