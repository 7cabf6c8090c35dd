"""Tables in the C++ core that name things the Python side defines."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_shared_settings_name_the_variables_python_reads():
    from bps_tf.runtime import config  # no TensorFlow, no native code

    table = re.search(r"kSharedSettings\[\]\s*=\s*\{(.*?)\};", _read("bps_tf", "core", "transport", "protocol.h"),
                      re.S).group(1)
    pairs = dict(re.findall(r'\{"(\w+)",\s*"(\w+)"\}', table))
    assert pairs, "protocol.h: kSharedSettings not found"
    by_key = {s.core_key: s.env for s in config.SETTINGS if s.core_key}
    cluster = _read("bps_tf", "runtime", "cluster.py")
    for key, env in pairs.items():
        if key in by_key:
            assert env == by_key[key], f"{key}: protocol.h says {env}, config.py {by_key[key]}"
        else:  # placement settings come from the cluster spec
            assert f'"{env}"' in cluster, f"{key}: {env} is not read by bps_tf/runtime/cluster.py"


def test_one_dtype_table():
    # Only dtypes.h spells out which dtypes the core carries.
    for folder in ("core", "kernels"):
        for root, _, names in os.walk(os.path.join(ROOT, "bps_tf", folder)):
            for name in names:
                if name == "dtypes.h" or not name.endswith((".h", ".cc")):
                    continue
                rel = os.path.relpath(os.path.join(root, name), os.path.join(ROOT, "bps_tf"))
                text = _read("bps_tf", rel)
                assert '"float16"' not in text and '"int64"' not in text, \
                    f"{rel} names dtypes outside dtypes.h"
