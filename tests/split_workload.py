"""A workload small enough for a test whose CLI peers split their model (tests/test_peer_group.py): the charlm
transformer at width 16, 2 layers of 2 heads, 16-byte windows. It has layers (FSDP2 shards each) and a ``stage``
method (pipeline stages)."""

from __future__ import annotations

from peers.charlm import CharLMWorkload


def tiny() -> CharLMWorkload:
    return CharLMWorkload(context=16, embed=16, layers=2, heads=2, text_bytes=40_000)
