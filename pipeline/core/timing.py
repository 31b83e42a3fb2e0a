"""Where the seconds of a piece of work went, by named part:

watch = Stopwatch()
with watch("generate"):
    ...
watch.parts  ->  {"generate": 0.412, ...}   (a part entered twice adds up)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] = round(self.parts.get(part, 0.0) + time.perf_counter() - t0, 4)
