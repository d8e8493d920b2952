"""sglang adapter package: adapter.py, envs/, drivers/."""
