"""Tasks: data, model, loss and metrics. Registered by name in :mod:`.registry`."""
