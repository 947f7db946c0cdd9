"""gRPC client library, the halfmoon CLI, trace loaders and replay, reports and plots."""
