"""kvbaton: the control plane that passes the KV cache between prefill and decode engines."""

__version__ = "0.1.0"
