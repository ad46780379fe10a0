"""What runs on Ray Train's controller (an actor beside the driver): the callbacks that relay
reports, failures and the worker group's phases to the driver. Callbacks here never raise."""
