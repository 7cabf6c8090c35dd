"""`python -m bps_tf.op_build`: build (or find) the op library now, e.g. in
a container image; the older module path of bps_tf.runtime.op_build, kept
for the scripts that call it. No TensorFlow is imported until it builds."""
from bps_tf.runtime.op_build import main

if __name__ == "__main__":
    main()
