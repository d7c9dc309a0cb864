"""Image soft tokens by content hash, least recently used first out within a byte budget.

A multi-turn chat resends its images with every turn; the prefix cache keeps their KV blocks
while they last, and this cache keeps their soft tokens, so the vision tower runs once per image
(the engine's stats count runs and hits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..inputs.model_inputs import ImagePatches


class VisionCache:
    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._features: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, image: ImagePatches, encode: Callable[[ImagePatches], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """The image's soft tokens, and whether they came from the cache (else `encode` ran)."""
        key = image.key
        if key in self._features:
            self._features.move_to_end(key)
            return self._features[key], True
        features = encode(image)
        size = features.numel() * features.element_size()
        if size <= self.max_bytes:
            self._features[key] = features
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._features.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
        return features, False

    def __len__(self) -> int:
        return len(self._features)
