"""The target of a cache build, loaded only when a part has to be computed (a derive may need none)."""
from __future__ import annotations

import time


class OnDemand:
    """A model loaded when first asked for (`load_s`: how long that took) and let go on `drop`."""

    def __init__(self, load):
        self._load, self._model, self.load_s = load, None, 0.0

    def get(self):
        if self._model is None:
            t = time.time()
            self._model = self._load()
            self.load_s = time.time() - t
        return self._model

    def drop(self) -> None:
        self._model = None
