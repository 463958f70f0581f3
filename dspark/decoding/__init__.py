"""Decoding: the static-shape decoding core and its KV interfaces, batch-1 speculative decoding (chains and
trees), the continuous-batching rollout generator and serving engine, sampling and the verify scheduler."""
