"""`python -m bps_tf.launch`: the same as `bpslaunch`."""
from bps_tf.launch.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
