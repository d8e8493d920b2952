"""omlx adapter package: adapter.py, envs/, drivers/."""
