"""How a pdserve service runs: start-up and shutdown (``service``), logging, signals,
gRPC servers and channels with health and internal trust (``rpc``, ``trust``), traces and
Prometheus metrics."""
