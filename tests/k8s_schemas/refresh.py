"""Rebuilds the vendored CRD schemas of this folder from upstream CRD files.

    python tests/k8s_schemas/refresh.py CRD.yaml [CRD.yaml ...]

Each CRD's served version's ``openAPIV3Schema`` is written to
``<plural>.<group>.<version>.json`` beside this script, with every
``description`` removed (the schema is the contract; the prose stays upstream)
and nothing else changed. README.md names the files it was run on.
"""
import json
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def _strip(node, field_names=False):
    # Under "properties" the keys are field names: a field called description stays.
    if isinstance(node, dict):
        return {k: _strip(v, k == "properties" and not field_names) for k, v in node.items()
                if field_names or k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def main(paths):
    for path in paths:
        with open(path) as f:
            crd = yaml.safe_load(f)
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            out = {"group": spec["group"], "kind": spec["names"]["kind"],
                   "version": version["name"], "scope": spec["scope"],
                   "openAPIV3Schema": _strip(version["schema"]["openAPIV3Schema"])}
            name = f"{spec['names']['plural']}.{spec['group']}.{version['name']}.json"
            with open(os.path.join(HERE, name), "w") as f:
                json.dump(out, f, indent=1, sort_keys=True)
                f.write("\n")
            print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
