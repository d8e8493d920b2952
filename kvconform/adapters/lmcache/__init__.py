"""lmcache adapter package: adapter.py, envs/, drivers/."""
