"""Which strategy is a BytePSStrategy, for code that must not import it.

The Keras hooks run for every model; they act only for models whose
``distribute_strategy`` is a BytePSStrategy (or bps_tf.distribute's
MirroredStrategy). The strategy's class carries a marker, so the hooks do
not import the strategy (which imports them).
"""
from __future__ import annotations

MARKER = "bps_tf_strategy"


def is_bps_strategy(strategy) -> bool:
    return strategy is not None and getattr(type(strategy), MARKER, False) is True


def of_model(model):
    """``model``'s BytePSStrategy, or None."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy if is_bps_strategy(strategy) else None


def multi_worker(model):
    """``model``'s BytePSStrategy when it has more than one worker, or None."""
    strategy = of_model(model)
    return strategy if strategy is not None and strategy.num_workers > 1 else None


def async_mode(model):
    """``model``'s BytePSStrategy in mode="async", or None."""
    strategy = of_model(model)
    return strategy if getattr(strategy, "mode", "sync") == "async" else None
