"""What lives in a run's storage directory: the checkpoint format and its verification, storage URIs,
and the lease that says which driver trains the run."""
