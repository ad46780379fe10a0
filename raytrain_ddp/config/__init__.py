"""The run configuration: its schema and defaults, how layers are put together, the recipe contract and
its signatures. Imported by every process; imports neither torch nor Ray."""
