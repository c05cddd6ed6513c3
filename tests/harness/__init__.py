"""Test harnesses that start real processes (etcd) for the integration suites."""
