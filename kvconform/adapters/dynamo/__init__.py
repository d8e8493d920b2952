"""dynamo adapter package: adapter.py, envs/, drivers/."""
