"""examples/keras_digits.py with two gates, for the elastic Kubernetes job of tests/test_k8s_jobs.py.

    k8s_digits_gated.py OUT_DIR JOIN_AT LEAVE_AT [keras_digits options]

The test adds and deletes a worker pod while ``fit`` runs; the gates make
sure that happens in the middle of training however slowly the machine runs,
without sleeps:

* at the start of epoch JOIN_AT, while 2 workers train, the workers ask for
  newcomers at every check (``check_host_updates``, as Horovod's elastic
  scripts do at a commit) until the test's new pod has asked to join; rank 0
  first writes ``gate1`` so the test knows when to add it;
* at the start of epoch LEAVE_AT, with 3 workers, each worker writes
  ``gate2_<pod index>`` and waits for ``go2``, which the test writes right
  after it sent SIGTERM to the pod it deletes. Whether that worker dies at
  once (a lost worker: the others restore the epoch's commit) or leaves at
  its next commit, the job goes on and finishes.

Rank 0 prints ``HISTORY [...]``: the epochs of fit's History.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))

import keras  # noqa: E402

import bps_tf  # noqa: E402
import keras_digits  # noqa: E402

OUT, JOIN_AT, LEAVE_AT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
POD = os.environ["JOB_COMPLETION_INDEX"]
WAIT_S = 300


def _touch(name):
    with open(os.path.join(OUT, name + ".tmp"), "w") as f:
        f.write(str(time.time()))
    os.replace(os.path.join(OUT, name + ".tmp"), os.path.join(OUT, name))


class Gates(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == JOIN_AT and bps_tf.size() == 2:
            if bps_tf.rank() == 0:
                _touch("gate1")
            deadline = time.time() + WAIT_S
            while time.time() < deadline:
                # Raises HostsUpdatedInterrupt on every worker once the new pod asked.
                bps_tf.elastic.ObjectState().check_host_updates()
                time.sleep(0.2)
            raise RuntimeError(f"no new worker asked to join within {WAIT_S} s")
        if epoch == LEAVE_AT and bps_tf.size() == 3:
            _touch(f"gate2_{POD}")
            deadline = time.time() + WAIT_S
            while not os.path.exists(os.path.join(OUT, "go2")):
                if time.time() > deadline:
                    raise RuntimeError(f"the test did not release gate 2 within {WAIT_S} s")
                time.sleep(0.1)


history = keras_digits.main(sys.argv[4:], callbacks=[Gates()])
if bps_tf.rank() == 0:
    print("HISTORY " + json.dumps(history.epoch), flush=True)
