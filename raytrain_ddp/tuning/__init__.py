"""Sweeps: trials of a run with Ray Tune (driver.py: the sweep; trial.py: a trial; table.py: what the user sees)."""
