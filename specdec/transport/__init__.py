"""gRPC at the edge: servers, channels, the one mapping from domain errors to
status codes, and the session-stream plumbing the model services share."""
