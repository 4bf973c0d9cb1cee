"""The target service: the large model that verifies a whole draft in one forward pass."""
