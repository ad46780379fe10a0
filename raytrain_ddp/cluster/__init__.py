"""The driver's view of the Ray cluster: which Ray to join, the session it runs in, and what the
cluster holds now."""
