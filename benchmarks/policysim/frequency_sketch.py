"""TinyLFU's frequency estimate (Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache
Admission Policy", ACM ToS 2017): a count-min sketch behind a doorkeeper, aged by halving.

- The doorkeeper, a Bloom filter, absorbs each block's first occurrence since the last reset, so
  one-off blocks never reach the counters; the estimate adds one for a block it holds.
- The count-min sketch: four rows of 4-bit counters (saturating at 15), a row as wide as the
  next power of two at or above the cache's capacity (Caffeine's ``FrequencySketch`` sizing);
  the estimate is the smallest of a block's four counters.
- Aging ("reset"): after ``sample_size`` = 10 x capacity recorded occurrences (the paper's W,
  Caffeine's sample), every counter is halved and the doorkeeper is cleared, so the estimate
  follows recent popularity.

Hashes are fixed (splitmix64 and double hashing): the same trace gives the same estimates.
"""

from __future__ import annotations

ROWS = 4
MAX_COUNT = 15
SAMPLE_FACTOR = 10
DOORKEEPER_HASHES = 3
# Doorkeeper bits per occurrence of a sample: a false-positive rate of a few per cent when full.
DOORKEEPER_BITS_PER_SAMPLE = 8
_HALF = bytes(value >> 1 for value in range(256))
_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a fixed 64-bit mix of the block id."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class FrequencySketch:
    def __init__(self, capacity: int) -> None:
        self.width = _power_of_two_at_least(capacity)
        self.sample_size = SAMPLE_FACTOR * capacity
        self.doorkeeper_bits = _power_of_two_at_least(DOORKEEPER_BITS_PER_SAMPLE * self.sample_size)
        self._rows = [bytearray(self.width) for _ in range(ROWS)]
        self._doorkeeper = bytearray(self.doorkeeper_bits)
        self._recorded = 0
        self.resets = 0

    def _hashes(self, block: int) -> tuple[int, int]:
        mixed = _mix(block)
        # Double hashing (Kirsch & Mitzenmacher): an odd step, so every slot is reachable.
        return mixed & 0xFFFFFFFF, (mixed >> 32) | 1

    def record(self, block: int) -> None:
        first, step = self._hashes(block)
        bits = self.doorkeeper_bits - 1
        door = [(first + i * step) & bits for i in range(DOORKEEPER_HASHES)]
        if all(self._doorkeeper[slot] for slot in door):
            mask = self.width - 1
            for row_index, row in enumerate(self._rows):
                slot = (first + row_index * step) & mask
                if row[slot] < MAX_COUNT:
                    row[slot] += 1
        else:
            for slot in door:
                self._doorkeeper[slot] = 1
        self._recorded += 1
        if self._recorded >= self.sample_size:
            self._reset()

    def estimate(self, block: int) -> int:
        first, step = self._hashes(block)
        mask = self.width - 1
        count = min(row[(first + index * step) & mask] for index, row in enumerate(self._rows))
        bits = self.doorkeeper_bits - 1
        seen = all(self._doorkeeper[(first + i * step) & bits] for i in range(DOORKEEPER_HASHES))
        return count + seen

    def _reset(self) -> None:
        self._rows = [row.translate(_HALF) for row in self._rows]
        self._doorkeeper = bytearray(self.doorkeeper_bits)
        self._recorded = 0
        self.resets += 1
