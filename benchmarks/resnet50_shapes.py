"""The trainable variables of Keras' ResNet-50 (names, shapes, creation order)
without TensorFlow and without weights.

The benchmarks push_pull one gradient per trainable variable, so the sizes
and the count of tensors matter (214 tensors, 25,583,592 float32 values,
about 102 MB). The list is derived from the architecture rather than typed
in; `python benchmarks/resnet50_shapes.py --verify` compares it with
`keras.applications.ResNet50(weights=None).trainable_variables`.
"""
from __future__ import annotations

import sys
from typing import List, Tuple

Shape = Tuple[int, ...]

# (stage name, blocks, bottleneck filters); the output has 4x the filters.
STAGES = (("conv2", 3, 64), ("conv3", 4, 128), ("conv4", 6, 256), ("conv5", 3, 512))


def _conv_bn(name: str, k: int, cin: int, cout: int) -> List[Tuple[str, Shape]]:
    return [(f"{name}_conv/kernel", (k, k, cin, cout)), (f"{name}_conv/bias", (cout,)),
            (f"{name}_bn/gamma", (cout,)), (f"{name}_bn/beta", (cout,))]


def resnet50_trainable_shapes() -> List[Tuple[str, Shape]]:
    """[(variable path, shape)] in the order of Keras' `trainable_variables`."""
    out = _conv_bn("conv1", 7, 3, 64)
    cin = 64
    for stage, blocks, filters in STAGES:
        for b in range(1, blocks + 1):
            name = f"{stage}_block{b}"
            out += _conv_bn(f"{name}_1", 1, cin, filters)
            out += _conv_bn(f"{name}_2", 3, filters, filters)
            last = _conv_bn(f"{name}_3", 1, filters, 4 * filters)
            if b == 1:
                # Keras' functional order interleaves the projection
                # shortcut with the last conv: 0_conv, 3_conv, 0_bn, 3_bn.
                short = _conv_bn(f"{name}_0", 1, cin, 4 * filters)
                out += short[:2] + last[:2] + short[2:] + last[2:]
            else:
                out += last
            cin = 4 * filters
    out += [("predictions/kernel", (cin, 1000)), ("predictions/bias", (1000,))]
    return out


def count_values(shapes) -> int:
    total = 0
    for _, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _verify() -> int:
    import keras  # only here: the benchmarks themselves never need it
    model = keras.applications.ResNet50(weights=None)
    theirs = [(v.path, tuple(v.shape)) for v in model.trainable_variables]
    ours = resnet50_trainable_shapes()
    if theirs != ours:
        for i, (a, b) in enumerate(zip(theirs, ours)):
            if a != b:
                print(f"first difference at {i}: keras {a}, ours {b}")
                break
        print(f"keras: {len(theirs)} variables, ours: {len(ours)}")
        return 1
    print(f"match: {len(ours)} variables, {count_values(ours):,} values")
    return 0


if __name__ == "__main__":
    if "--verify" in sys.argv:
        sys.exit(_verify())
    shapes = resnet50_trainable_shapes()
    print(f"{len(shapes)} variables, {count_values(shapes):,} values")
