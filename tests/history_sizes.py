"""How much a Temporal history weighs: every payload it recorded (inputs, results, heartbeats)."""
from __future__ import annotations


def payload_sizes(history) -> list[int]:
    """Byte sizes of every payload recorded in a history (inputs, results, heartbeats, signals)."""
    sizes = []

    def walk(msg):
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            if hasattr(value, "ListFields"):
                items = [value]
            elif hasattr(value, "values") and callable(value.values):    # map fields (memo, headers)
                items = list(value.values())
            else:                                                         # repeated fields
                items = list(value)
            for v in items:
                if field.message_type.full_name == "temporal.api.common.v1.Payload":
                    sizes.append(v.ByteSize())
                elif hasattr(v, "ListFields"):
                    walk(v)
    for e in history.events:
        walk(e)
    return sizes
