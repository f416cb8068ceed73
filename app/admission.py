"""Which service classes an ingress replica takes more of: each class may hold at most its share of the replica's
request slots (the decode engines' concurrent requests, app/config.py `ingress_slots`), so that batch work never
fills the slots interactive requests need. Pure: the ingress counts, this decides."""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping


class ClassAdmission:
    def __init__(self, slots: int, max_share: Mapping[str, float]):
        # At least one: a class with a share of a slot still gets one.
        self.limits = {name: max(1, math.floor(share * slots)) for name, share in max_share.items()}
        self.held: Counter[str] = Counter()

    def try_take(self, pd_class: str) -> bool:
        """Takes a slot for a request of `pd_class` if the class is under its limit."""
        if self.held[pd_class] >= self.limits[pd_class]:
            return False
        self.held[pd_class] += 1
        return True

    def release(self, pd_class: str) -> None:
        self.held[pd_class] -= 1
