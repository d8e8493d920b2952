"""trtllm adapter package: adapter.py, envs/, drivers/."""
