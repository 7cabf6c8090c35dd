"""Regenerates the table of bps_tf's hooks into Keras and TensorFlow in
docs/dependencies.md from the hook registry (bps_tf/hooks/registry.py).

    python tools/gen_hooks_doc.py          # rewrite the table
    python tools/gen_hooks_doc.py --check  # exit 1 if the doc is stale

Imports the bps_tf on sys.path (the installed one, or the checkout with
PYTHONPATH): every module that declares hooks is imported, which loads
TensorFlow, Keras and the op library.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "dependencies.md")
BEGIN, END = "<!-- hooks:begin -->", "<!-- hooks:end -->"
# Every module that declares hooks (importing it declares them).
DECLARING = ("bps_tf.ops", "bps_tf.hooks.keras_shared", "bps_tf.hooks.tf_internals",
             "bps_tf.comm.optimizer_variables", "bps_tf.horovod.sync_batch_norm_entries",
             "bps_tf.overlap.guard", "bps_tf.overlap.engine", "bps_tf.overlap.fit",
             "bps_tf.overlap.fit_entries", "bps_tf.overlap.loop", "bps_tf.strategy.keras_hooks",
             "bps_tf.strategy.epoch_length", "bps_tf.strategy.checkpoint_hooks",
             "bps_tf.strategy.data_check", "bps_tf.keras.optimizer_entries",
             "bps_tf.strategy.batch_share", "bps_tf.strategy.callback_state")


def declare_all():
    """Imports every module that declares entries; returns the registry."""
    import importlib
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for module in DECLARING:
        importlib.import_module(module)
    from bps_tf.hooks import registry
    return registry


def table() -> str:
    hooks = declare_all()
    every = hooks.hooks()
    kinds = {kind: [h for h in every if h.kind == kind] for kind in hooks.KINDS}
    summary = (f"{len(every)} entries: {len(kinds['wraps'])} wrapped targets "
               f"({sum(h.private for h in kinds['wraps'])} of them private names), "
               f"{len(kinds['uses'])} private methods used or overridden, "
               f"{len(kinds['reads'])} attributes of Keras objects read or written, "
               f"{len(kinds['patches'])} patches of single objects, "
               f"{len(kinds['imports'])} TensorFlow internal modules. Verified on Keras "
               f"{hooks.VERIFIED_KERAS}, TensorFlow {hooks.VERIFIED_TF}.")
    return summary + "\n\n" + hooks.markdown_table() + "\n"


def rendered(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def main() -> int:
    with open(DOC) as f:
        text = f.read()
    new = rendered(text)
    if "--check" in sys.argv:
        if new != text:
            print("docs/dependencies.md: the hooks table is stale; run tools/gen_hooks_doc.py")
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
