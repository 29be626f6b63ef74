"""The gateway: the gRPC front door, tokenizer, router and prefill/decode orchestration."""
