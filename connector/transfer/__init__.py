"""The data path: KV geometry, NIXL descriptors, the NIXL endpoint, the pack path
(staging) and KV fingerprints. Knows nothing of vLLM or gRPC (an import contract)."""
