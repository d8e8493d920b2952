"""vllm adapter package: adapter.py, envs/, drivers/."""
