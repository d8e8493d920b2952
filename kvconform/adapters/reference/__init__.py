"""reference adapter package: adapter.py, envs/, drivers/."""
