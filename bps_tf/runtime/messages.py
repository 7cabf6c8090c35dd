"""Other programs' error texts inside bps_tf's own one-line messages.

A worker's reason for leaving travels to the scheduler and is repeated by
every server and worker ("the job failed: worker 1 ... failed (ValueError:
...)"), so it must be one line of bounded length. It is cut at a word
boundary, marked, never inside a word; TensorFlow's decoration of an op's
error (which function and device ran it) is dropped: the op's own words stay.

No TensorFlow here.
"""
from __future__ import annotations

import re

MAX_CHARS = 400
_TF_FUNCTION = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_TF_OP = re.compile(r"\s*\[Op:[\w.]+\](\s*name:\s*\S*)?\s*$")


def one_line(text: object, limit: int = MAX_CHARS) -> str:
    """``text`` on one line, without TensorFlow's op decoration, at most
    ``limit`` characters (plus " ..." when cut, at a space)."""
    words = " ".join(str(text).split())
    words = _TF_OP.sub("", _TF_FUNCTION.sub("", words))
    if len(words) <= limit:
        return words
    head = words[:limit + 1]
    cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else words[:limit]).rstrip(" ,;:") + " ..."
