"""The plain types every pdserve process shares, free of torch and gRPC: the served model
(its config and limits, fingerprint, tokenizer and chat template) and a request's sampling
parameters, finish reasons and speculation counters. Everything else points inward to it."""
