"""What is checked before any training worker starts, so that bad input costs seconds and writes
nothing."""
