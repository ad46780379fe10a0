"""Seeds: one independent stream of randomness per purpose, epoch and rank, all derived from
`train.seed`, so that a run's order and augmentation are a function of (seed, epoch, rank) alone."""

import numpy as np

SHUFFLE, WORKER_RNG, LOADER, FILE_ORDER, LENGTH_GROUPS = 0, 1, 2, 3, 4  # the purposes derive_seed serves


def derive_seed(seed: int, *keys: int) -> int:
    """An independent 32-bit seed for each (seed, *keys): one per purpose, epoch and rank."""
    return int(np.random.SeedSequence(seed, spawn_key=keys).generate_state(1)[0])
