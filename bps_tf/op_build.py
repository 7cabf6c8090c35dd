"""`python -m bps_tf.op_build`: build (or find) the op library now, e.g. in
a container image (bps_tf/ops/op_build.py builds it). The builder is loaded
by its path: importing the bps_tf.ops package would load the very library
it is asked to build, and TensorFlow with it; here no TensorFlow is
imported until it builds."""
import importlib.util
import os
import sys


def load_builder():
    """bps_tf/ops/op_build.py as a module of its own, without importing the
    bps_tf.ops package (setup.py loads it the same way)."""
    name = "bps_tf_op_builder"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops", "op_build.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


if __name__ == "__main__":
    load_builder().main()
