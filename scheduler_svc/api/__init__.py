"""The public gRPC API: servicer, server (with health, reflection and the malformed-request
guard) and the conversion between protobuf and the engine's records."""
