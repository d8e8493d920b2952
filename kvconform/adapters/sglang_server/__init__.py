"""sglang-server adapter package: adapter.py, envs/."""
