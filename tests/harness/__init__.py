"""Test-only helpers: a TCP proxy that can cut connections (partition tests). The process
launchers (vLLM servers, the P/D stack, etcd clusters) live in :mod:`kvbaton.stack`."""
