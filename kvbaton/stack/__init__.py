"""Launchers for real processes: vLLM OpenAI servers, a whole P/D stack (control plane,
prefill + decode engines, routers) and local etcd clusters.

Why in the product: the main job (``kvbaton.pd_demo``, ``scripts/run.sh``), every
benchmark and the e2e tests start the same processes the same way; keeping the launcher
here means none of them imports ``tests``.
"""
