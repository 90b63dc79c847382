"""gRPC plumbing shared by edges, origins and clients: channel options, auth, error mapping."""
