"""One run on the driver: the plan, the trainer, the console while it trains and the summary after."""
