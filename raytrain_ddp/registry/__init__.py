"""MLflow, from the driver only: the tracking server and store, one MLflow run per training run, model
logging, registration and the champion alias."""
