"""`python -m bps_tf.launcher`: the launcher's older module path, kept for
scripts and images that call it (the same as `bpslaunch` and
`python -m bps_tf.launch`)."""
from bps_tf.launch.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
