"""The public functions: argument checks, options, and the loss and log-probabilities built from row statistics."""
