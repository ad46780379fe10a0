"""A run's data: the recipe's datasets, their seeds and fingerprints, and streamed datasets (the
recipe-facing classes, the pure epoch plan, the reading pipeline)."""
