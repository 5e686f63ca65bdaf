"""The wire: the gRPC server and servicer, the memory handoff socket, service notification. Nothing decides here."""
