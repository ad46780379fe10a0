"""What runs in each Ray Train worker: the training loop, the optimizer step, metrics, early stopping,
the progress beacon and the worker's setup. Never imports the driver side or the registry."""
