"""Generated gRPC stubs of the specdec.v1 wire contract (do not edit)."""
